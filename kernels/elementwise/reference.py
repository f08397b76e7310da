"""Plain definitions (fp64 where it matters), no invariance claim."""

import torch
import torch.nn.functional as F


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.double()) * up.double()).to(gate.dtype)


def rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF Qwen3 rotate-half RoPE in fp64. x [T, heads, d], positions [T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    emb = torch.cat([positions.double()[:, None] * inv_freq] * 2, -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    xd = x.double()
    return (xd * cos + torch.cat([-xd[..., d // 2:], xd[..., : d // 2]], -1) * sin).to(x.dtype)
