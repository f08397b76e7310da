"""LayerNorm on CPU: one compiled call (kernels/csrc/dsa.cpp `layer_norm`), nn.LayerNorm's
semantics (fp32 inside, rounded once to x's dtype). The mean and the variance are sums in 16
lanes combined by a fixed tree, so a row's bits depend on the row alone (ATen's LayerNorm
keeps per-row code too, but its blocking is not ours to fix: this is). Backward: the gradient
of F.layer_norm, recomputed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_rl.kernels.cpu_ext import ops as _ops


def layer_norm_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch (the stock mode's and the backward's)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.save_for_backward(x, weight, bias)
        ctx.eps = eps
        return _ops().layer_norm(x, weight, bias, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
            grads = torch.autograd.grad(layer_norm_eager(*leaves, ctx.eps), leaves, grad)
        return (*grads, None)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of x with weight / bias [N]; rows independent."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, bias)):
        return _LayerNorm.apply(x, weight, bias, eps)
    return _ops().layer_norm(x, weight, bias, eps)
