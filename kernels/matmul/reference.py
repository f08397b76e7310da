"""Reference linear: y = x @ W^T. No invariance claim."""

import torch


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight)
