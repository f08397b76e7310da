"""Plain definitions (fp64 where it matters), no invariance claim."""

import torch
import torch.nn.functional as F


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.double()) * up.double()).to(gate.dtype)


def rope_angles(positions: torch.Tensor, d: int, theta: float) -> torch.Tensor:
    """HF's rotary angles [T, d]: inv_freq and pos * inv_freq in fp32, as transformers
    computes them (the angle's own fp32 rounding, up to pos * 2^-24 rad, is part of the
    definition, not an error of the kernels)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs, freqs], -1)


def rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF Qwen3 rotate-half RoPE: HF's fp32 angles, then cos/sin and the rotation in fp64.
    x [T, heads, d], positions [T]."""
    d = x.shape[-1]
    emb = rope_angles(positions, d, theta).double()
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    xd = x.double()
    return (xd * cos + torch.cat([-xd[..., d // 2:], xd[..., : d // 2]], -1) * sin).to(x.dtype)


def rope_error_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element, a bound on |kernel - rope_reference| in fp64, for any input: with the
    angle shared, the kernel rounds cos/sin to `dtype` (torch's fp32 cos/sin are within
    2 ulp), each of the two products and their sum (one unit roundoff u each), so
    |err| <= (2u + 2u)(|x1| + |x2|) + u|y| <= 6u(|x1| + |x2|) with |y| <= |x1| + |x2|;
    8u(|x1| + |x2|) is used, plus the reference's own output rounding (u |y|)."""
    d = x.shape[-1]
    u = torch.finfo(dtype).eps / 2  # unit roundoff
    xd = x.double().abs()
    pair = xd + torch.cat([xd[..., d // 2:], xd[..., : d // 2]], -1)
    return 9 * u * pair + torch.finfo(torch.float64).tiny
