"""Autograd helpers of the kernels: a forward kernel with an eager backward, and a split
of a fused GEMM's output whose backward does not copy.

with_eager_backward:

Only the forward of a kernel op has to match the other engine bit for bit (it produces
the log-probs both sides compare); its backward is the gradient of the same math, so it
recomputes the op with an eager torch definition under autograd (as the CPU kernels'
own autograd Functions do). `with_eager_backward(fast, eager)` returns a function that
calls `fast` when no input needs a gradient, and otherwise `fast` for the values and
`eager` for the backward. Tensor arguments are saved; other arguments pass through.

split_last: see there.
"""

from __future__ import annotations

from typing import Callable

import torch


class _EagerBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fast, eager, spec, *tensors):
        ctx.eager, ctx.spec = eager, spec
        ctx.save_for_backward(*tensors)
        return fast(*_merge(spec, tensors))

    @staticmethod
    def backward(ctx, grad):
        ts = ctx.saved_tensors
        need = ctx.needs_input_grad[3:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip(ts, need)]
            out = ctx.eager(*_merge(ctx.spec, leaves))
            wrt = [x for x, n in zip(leaves, need) if n]
            got = iter(torch.autograd.grad(out, wrt, grad.to(out.dtype), allow_unused=True))
        grads = [next(got) if n else None for n in need]
        return (None, None, None, *grads)


def _merge(spec: tuple, tensors) -> list:
    """spec: per positional argument, a tensor slot (None) or the non-tensor value."""
    it = iter(tensors)
    return [next(it) if s is _TENSOR else s for s in spec]


_TENSOR = object()


def with_eager_backward(fast: Callable, eager: Callable) -> Callable:
    """fast(*args) for the values, eager(*args)'s gradient for the backward (positional
    arguments only; floating tensors may require grad)."""

    def op(*args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return fast(*args)
        spec = tuple(_TENSOR if isinstance(a, torch.Tensor) else a for a in args)
        return _EagerBackward.apply(fast, eager, spec, *tensors)

    op.__name__ = op.__qualname__ = getattr(fast, "__name__", "op").lstrip("_")
    op.__module__ = fast.__module__
    op.__doc__ = fast.__doc__
    return op


class _SplitLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, sizes):
        ctx.sizes = sizes
        return tuple(y.split(sizes, -1))

    @staticmethod
    def backward(ctx, *grads):
        return _joined(grads, ctx.sizes), None


def _joined(grads, sizes) -> torch.Tensor:
    """The gradients of y's column blocks as one tensor: their common buffer itself where
    they are its consecutive column blocks (no copy), else a concatenation."""
    base = grads[0]._base if grads[0] is not None else None
    if base is not None and base.is_contiguous() and base.shape[:-1] == grads[0].shape[:-1] \
            and base.shape[-1] == sum(sizes):
        views = base.split(sizes, -1)
        if all(g is not None and g._base is base and g.data_ptr() == v.data_ptr() and g.stride() == v.stride()
               for g, v in zip(grads, views)):
            return base
    ref = next(g for g in grads if g is not None)
    return torch.cat([g if g is not None else ref.new_zeros(*ref.shape[:-1], n) for g, n in zip(grads, sizes)], -1)


def split_last(y: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """y.split(sizes, -1) (the q/k/v or gate/up blocks of one fused GEMM output) whose
    backward passes the consumers' gradients on as y's without copying them when they
    are the consecutive blocks of one buffer (the compiled silu_mul backward writes d_gate
    and d_up so); autograd's own split would concatenate them (a copy of y's size)."""
    if not (torch.is_grad_enabled() and y.requires_grad):
        return list(y.split(sizes, -1))
    return list(_SplitLast.apply(y, list(sizes)))
