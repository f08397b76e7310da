"""Top-k / top-p drop masks in Triton, without a sort: one program per row.

The rule is torch_impl's (vLLM's semantics with ties broken by token id), computed by
searches over the values' order instead of a sorted copy:
  * order: token i before token j when (x_i, i) < (x_j, j); values are compared through a
    monotone int32 key of their bits;
  * top-k: tau = the largest key with count(key >= tau) >= k (33 bisection steps over the
    int32 range, each a count over the row): tokens below tau are dropped, ties at the
    k-th largest kept;
  * top-p over the top-k survivors: q = softmax (fp32, max then sum of exp, chunks of
    BLOCK_V in order); B = the largest key with mass(key < B) <= 1 - p (33 steps); tokens
    with key < B are dropped, and a token tied at B with rank r among the ties (by id)
    is dropped when mass(key < B) + (r + 1) * q_B <= 1 - p; the last token in the order
    (the largest, highest id) is always kept.
Counts are exact and every mass is the same fp32 sum over the row's chunks in a fixed
order, so a row's mask depends on that row only. The masses are not the bits of a sorted
cumsum (torch_impl's): both engines on a device run the same implementation
(kernels/dispatch.py), so they agree with each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_rl.kernels.sampling.torch_impl import per_row

BLOCK_V = 1024  # vocabulary chunk; fixed
STEPS = 33  # bisection steps over the int32 key range


@triton.jit
def _key(x):
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _drop_kernel(x_ptr, k_ptr, p_ptr, d_ptr, V, sx, sd, USE_K: tl.constexpr, USE_P: tl.constexpr,
                 BLOCK_V: tl.constexpr, STEPS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_V)
    kmin = -2147483648
    tau = tl.full((), kmin, tl.int64)  # top-k threshold key (kmin: nothing dropped)
    if USE_K:
        k = tl.load(k_ptr + row).to(tl.int64)
        if (k > 0) & (k < V):
            lo = tl.full((), kmin, tl.int64)
            hi = tl.full((), 2147483647, tl.int64)
            for _ in range(STEPS):
                mid = (lo + hi + 1) // 2
                cnt = tl.zeros((), tl.int64)
                for v0 in range(0, V, BLOCK_V):
                    m = v0 + offs < V
                    x = tl.load(x_ptr + row * sx + v0 + offs, mask=m, other=float("-inf"))
                    cnt += tl.sum((m & (_key(x) >= mid)).to(tl.int64), axis=0)
                ok = cnt >= k  # invariant: count(key >= lo) >= k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
            tau = lo
    bnd = tl.full((), kmin, tl.int64)  # top-p boundary key
    low_mass = tl.zeros((), tl.float32)
    q_b = tl.zeros((), tl.float32)
    keymax = tl.full((), kmin, tl.int64)
    pp = tl.full((), 1.0, tl.float32)
    if USE_P:
        pp = tl.load(p_ptr + row).to(tl.float32)
    limit = 1 - pp
    if pp < 1:
        mx = tl.full((), float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            m = v0 + offs < V
            x = tl.load(x_ptr + row * sx + v0 + offs, mask=m, other=float("-inf"))
            x = tl.where(_key(x) >= tau, x, float("-inf"))
            mx = tl.maximum(mx, tl.max(x, axis=0))
            keymax = tl.maximum(keymax, tl.max(tl.where(m, _key(x), kmin), axis=0))
        z = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            m = v0 + offs < V
            x = tl.load(x_ptr + row * sx + v0 + offs, mask=m, other=float("-inf"))
            x = tl.where(_key(x) >= tau, x, float("-inf"))
            z += tl.sum(tl.exp(x - mx), axis=0)
        lo = tl.full((), kmin, tl.int64)
        hi = tl.full((), 2147483647, tl.int64)
        for _ in range(STEPS):  # the largest B with mass(key < B) <= 1 - p
            mid = (lo + hi + 1) // 2
            mass = tl.zeros((), tl.float32)
            for v0 in range(0, V, BLOCK_V):
                m = v0 + offs < V
                x = tl.load(x_ptr + row * sx + v0 + offs, mask=m, other=float("-inf"))
                kx = _key(x)
                q = tl.exp(tl.where(kx >= tau, x, float("-inf")) - mx) / z
                mass += tl.sum(tl.where(m & (kx < mid), q, 0.0), axis=0)
            ok = mass <= limit  # invariant: mass(key < lo) <= 1 - p
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        bnd = lo
        for v0 in range(0, V, BLOCK_V):
            m = v0 + offs < V
            x = tl.load(x_ptr + row * sx + v0 + offs, mask=m, other=float("-inf"))
            kx = _key(x)
            q = tl.exp(tl.where(kx >= tau, x, float("-inf")) - mx) / z
            low_mass += tl.sum(tl.where(m & (kx < bnd), q, 0.0), axis=0)
            q_b = tl.maximum(q_b, tl.max(tl.where(m & (kx == bnd), q, 0.0), axis=0))
    ties_before = tl.zeros((), tl.int64)
    n_max = tl.zeros((), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        m = v0 + offs < V
        n_max += tl.sum((m & (_key(tl.load(x_ptr + row * sx + v0 + offs, mask=m, other=0.0)) == keymax))
                        .to(tl.int64), axis=0)
    seen_max = tl.zeros((), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        m = v0 + offs < V
        x = tl.load(x_ptr + row * sx + v0 + offs, mask=m, other=float("-inf"))
        kx = _key(x)
        drop = kx < tau
        if pp < 1:
            tie = m & (kx == bnd)
            rank = ties_before + tl.cumsum(tie.to(tl.int64), axis=0) - 1
            drop_p = (kx < bnd) | (tie & (low_mass + (rank + 1).to(tl.float32) * q_b <= limit))
            is_max = m & (kx == keymax)
            last = is_max & (seen_max + tl.cumsum(is_max.to(tl.int64), axis=0) == n_max)
            drop = drop | (drop_p & ~last)
            ties_before += tl.sum(tie.to(tl.int64), axis=0)
            seen_max += tl.sum(is_max.to(tl.int64), axis=0)
        tl.store(d_ptr + row * sd + v0 + offs, drop.to(tl.int8), mask=m)


@torch.no_grad()
def drop_mask(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """torch_impl.drop_mask's contract: bool [N, V], the entries top-k / top-p remove."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    N, V = logits.shape
    x = logits.detach().float().contiguous()
    k = per_row(k, N, torch.long, x.device)
    p = per_row(p, N, torch.float32, x.device)
    out = torch.zeros(N, V, dtype=torch.int8, device=x.device)
    if N and (k is not None or p is not None):
        _drop_kernel[(N,)](x, x if k is None else k.contiguous(), x if p is None else p.contiguous(), out, V,
                           x.stride(0), out.stride(0), USE_K=k is not None, USE_P=p is not None,
                           BLOCK_V=BLOCK_V, STEPS=STEPS, enable_fp_fusion=False)
    return out.bool()
