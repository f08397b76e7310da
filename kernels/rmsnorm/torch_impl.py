"""RMSNorm on CPU: one compiled call per norm (kernels/csrc/rowwise.cpp), Qwen3/HF
semantics (normalise in fp32, round to the input dtype, scale by the weight). A row's sum
of squares is 16 partial sums combined by a fixed tree, so its bits depend on the row
alone. The backward is the gradient of the same function in eager torch (recomputed):
only the forward has to match the engine bit for bit.
"""

import torch

from titan_rl.kernels.cpu_ext import ops as _ops


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
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gx, gw = torch.autograd.grad(rms_norm_eager(x_, w_, ctx.eps), (x_, w_), grad)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return _ops().rms_norm(x, weight, eps)
