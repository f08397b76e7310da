"""Reference causal GQA attention (fp64 softmax), no invariance claim."""

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, L, H, D], k/v [B, L, Hkv, D]; causal from position 0. Returns [B, L, H, D]."""
    h, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=2)
    v = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("blhd,bmhd->bhlm", q.double(), k.double()) * scale
    L = q.shape[1]
    mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.einsum("bhlm,bmhd->blhd", s.softmax(-1), v.double())
    return o.to(q.dtype)
