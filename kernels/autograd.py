"""A forward kernel with the gradient of the same function computed in eager torch.

Only the forward of a kernel op has to match the other engine bit for bit (it produces
the log-probs both sides compare); its backward is the gradient of the same math, so it
recomputes the op with an eager torch definition under autograd (as the CPU kernels'
own autograd Functions do). `with_eager_backward(fast, eager)` returns a function that
calls `fast` when no input needs a gradient, and otherwise `fast` for the values and
`eager` for the backward. Tensor arguments are saved; other arguments pass through.
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
