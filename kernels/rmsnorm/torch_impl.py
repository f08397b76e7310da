"""RMSNorm on CPU: one compiled call per norm (kernels/csrc/rowwise.cpp), Qwen3/HF
semantics (normalise in fp32, round to the input dtype, scale by the weight). A row's sum
of squares is 16 partial sums combined by a fixed tree, so its bits depend on the row
alone. The backward is compiled too (`rms_norm_backward`, fp32, the same lanes and tree):
a row's input gradient depends on the row alone, the weight gradient's sum over rows on
nothing but the rows (a fixed order, threads split columns). Only the forward has to
match the engine bit for bit; the backward must not depend on threads or layout.
`rms_norm_eager` is the same function in plain torch (stock mode, the Triton form's
backward).
"""

from typing import Callable

import torch

from titan_rl.kernels.cpu_ext import ops as _ops
from titan_rl.kernels.matmul.blocks import padded_tree_sum
from titan_rl.kernels.matmul.torch_impl import tree_sum


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same function in plain torch (stock mode; the backward)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _ops().rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx, gw = _ops().rms_norm_backward(grad, x, weight, ctx.eps, 1)
        return gx, gw[0].to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return _ops().rms_norm(x, weight, eps)


class _HeadRMSNorm(torch.autograd.Function):
    """rms_norm of x [..., H, D] by one weight [D] shared by the H heads. The input
    gradient is `_RMSNorm`'s (a row's bits depend on the row alone). The weight gradient
    is taken per head (head h: its rows' products summed over the rows, a reduction of
    fixed shape), `gather` brings all H heads' partials together (TP: each rank holds
    its heads; None: this call holds them all) and a fixed tree over heads adds them.
    `norm` is the form's rms_norm (the forward), `tree` its tree_sum: the Triton form
    (triton_impl.rms_norm_heads) passes its own."""

    @staticmethod
    def forward(ctx, x, weight, eps, gather, norm, tree):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.gather, ctx.tree = eps, gather, tree
        return norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if x.device.type == "cpu":  # the compiled backward, its per-head partials
            gx, parts = _ops().rms_norm_backward(grad, x, weight, ctx.eps, x.shape[-2])
            if ctx.gather is not None:
                parts = ctx.gather(parts)
            return gx, padded_tree_sum(parts, ctx.tree).to(weight.dtype), None, None, None, None
        with torch.enable_grad():
            x_ = x.detach().requires_grad_()
            xf = x_.float()
            xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype)
            gx, = torch.autograd.grad(weight.detach() * xn, (x_,), grad)
        d = x.shape[-1]
        xn, grad = xn.detach(), grad.to(torch.promote_types(weight.dtype, x.dtype))
        parts = torch.stack([(grad.select(-2, h).reshape(-1, d) * xn.select(-2, h).reshape(-1, d)).float().sum(0)
                             for h in range(x.shape[-2])])
        if ctx.gather is not None:
            parts = ctx.gather(parts)
        return gx, padded_tree_sum(parts, ctx.tree).to(weight.dtype), None, None, None, None


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """rms_norm (the same forward bits) of per-head vectors x [..., H, D] (q_norm/k_norm),
    whose weight gradient is a fixed tree over heads: the same bits whatever number of the
    heads one call holds, with `gather(parts [h, D]) -> [H, D]` joining the TP ranks' heads."""
    return head_rms_norm(x, weight, eps, gather, lambda *a: _ops().rms_norm(*a), tree_sum)


def head_rms_norm(x, weight, eps, gather, norm: Callable, tree: Callable) -> torch.Tensor:
    """rms_norm_heads over a form's `norm` and `tree` (torch: the compiled norm, tree_sum)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _HeadRMSNorm.apply(x, weight, eps, gather, norm, tree)
    return norm(x, weight, eps)
