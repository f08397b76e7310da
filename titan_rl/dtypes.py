"""Compute dtypes by their config names ("bfloat16", "float32") and back."""

import torch

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
