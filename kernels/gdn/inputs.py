"""The input checks and shape facts the GDN kernels share (recurrent and chunked forms)."""

from __future__ import annotations

import torch


def sequence_lengths(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, list[int]]:
    """(cu_seqlens as int64, each sequence's length) for a stream of T tokens."""
    cu = cu_seqlens.long()
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError("cu_seqlens must be 1-D with N+1 entries")
    lens = cu[1:] - cu[:-1]
    lens_l = lens.tolist()
    if int(cu[0]) != 0 or int(cu[-1]) != T or any(n < 0 for n in lens_l):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu.tolist()}")
    return cu, lens_l


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    T, Hk, dk = q.shape
    if k.shape != q.shape or v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"q, k [T, Hk, dk], v [T, Hv, dv]: got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    Hv = v.shape[1]
    if Hv % Hk:
        raise ValueError(f"num_v_heads {Hv} is not a multiple of num_k_heads {Hk}")
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"g, beta must be [T, Hv] = {(T, Hv)}, got {tuple(g.shape)}, {tuple(beta.shape)}")


def compute_dtype(v: torch.Tensor) -> torch.dtype:
    """fp32 state and arithmetic; fp64 only for fp64 inputs (gradchecks)."""
    return torch.float64 if v.dtype == torch.float64 else torch.float32
