"""The plain definition: the sum in fp64 (no order claim)."""

import torch


def sum_reference(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return x.double().sum() if dim is None else x.double().sum(dim)
