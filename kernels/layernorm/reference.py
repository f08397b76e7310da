"""Reference LayerNorm: torch.nn.LayerNorm's definition in fp64, cast to x's dtype."""

import torch


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    return ((xf - mean) / torch.sqrt(var + eps) * weight.double() + bias.double()).to(x.dtype)
