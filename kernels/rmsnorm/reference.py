"""Reference RMSNorm (Qwen3/HF semantics): normalise in fp32, scale in the input dtype."""

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    y = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
