"""Chunkwise-parallel gated delta rule (plain torch, batched). NOT bitwise equal to the
exact recurrent form (different summation order: GEMMs and a triangular solve); used as
the backward of gdn_recurrent (recomputed under autograd) and as a fast baseline.

Derivation (one head, one chunk of C tokens, state S0 entering the chunk). Let
G_t = sum_{s<=t} g_s within the chunk (cumulative log decay) and gamma_t = exp(G_t).
Unrolling the recurrence,
    S_t = gamma_t S0 + sum_{s<=t} exp(G_t - G_s) k_s u_s^T,
    u_t = beta_t (v_t - gamma_t S0^T k_t - sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s).
So (I + A) U = diag(beta) (V - diag(gamma) K S0) with A strictly lower triangular,
A[t, s] = beta_t exp(G_t - G_s) (k_t . k_s). With the UT transform
    W = (I + A)^{-1} diag(beta gamma) K,   U~ = (I + A)^{-1} diag(beta) V
(triangular solves, independent of S0, computed for all chunks at once) we get
U = U~ - W S0, and
    O = scale (diag(gamma) Q S0 + (M * Q K^T) U),   M[t, s] = exp(G_t - G_s) for s <= t,
    S_C = gamma_C S0 + (diag(exp(G_C - G)) K)^T U.
Only the last two lines depend on S0: a sequential loop over chunks, batched GEMMs over
(sequence, head). Every exponent is <= 0 (upper triangles are masked to -inf BEFORE the
exp), so nothing overflows.

Varlen: sequences are padded to [N, nchunks * C]; padding tokens get g = 0, beta = 0,
k = v = 0, so they leave the state unchanged (u = 0, decay 1) and the final state is the
state after each sequence's last token.
"""

from __future__ import annotations

import torch

from titan_rl.kernels.gdn.cache_rows import CacheRows
from titan_rl.kernels.gdn.inputs import check_shapes, compute_dtype, sequence_lengths


def gdn_chunked(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, chunk_size=64):
    """Same signature and returns as gdn_recurrent (o in v's dtype, final_state fp32, or
    fp64 for fp64 inputs), chunk size `chunk_size` (capped at the longest sequence).
    Differentiable by autograd w.r.t. q, k, v, g, beta and initial_state."""
    if isinstance(initial_state, CacheRows):
        return initial_state.through(gdn_chunked, q, k, v, g, beta, cu_seqlens, scale=scale, chunk_size=chunk_size)
    check_shapes(q, k, v, g, beta)
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    if scale is None:
        scale = dk ** -0.5
    cdt = compute_dtype(v)
    dev = v.device
    cu, lens_l = sequence_lengths(cu_seqlens, T)
    N = len(lens_l)
    S = (initial_state.to(cdt) if initial_state is not None
         else torch.zeros(N, Hv, dk, dv, dtype=cdt, device=dev))
    Lmax = max(lens_l, default=0)
    if Lmax == 0:
        return v.new_empty(T, Hv, dv), S + 0
    C = min(chunk_size, Lmax)
    nc = -(-Lmax // C)
    Lp = nc * C
    lens = torch.tensor(lens_l, device=dev)
    pos = torch.arange(Lp, device=dev)
    valid = pos[None, :] < lens[:, None]  # [N, Lp]
    idx = (cu[:-1, None] + pos[None, :]).clamp(max=T - 1)
    head = torch.arange(Hv, device=dev) // (Hv // Hk)

    def padded(x, heads=None):  # [T, H, ...] -> [N, Hv, nc, C, ...], zero at padding tokens
        x = x.to(cdt)
        if heads is not None:
            x = x[:, heads]
        x = x[idx]  # [N, Lp, Hv, ...]
        m = valid.view(N, Lp, *([1] * (x.dim() - 2)))
        x = torch.where(m, x, torch.zeros((), dtype=cdt, device=dev))
        x = x.movedim(2, 1)  # [N, Hv, Lp, ...]
        return x.reshape(N, Hv, nc, C, *x.shape[3:])

    Q, K, V = padded(q, head), padded(k, head), padded(v)  # [N, Hv, nc, C, d]
    Gc = padded(g).cumsum(-1)  # [N, Hv, nc, C]
    Bt = padded(beta)
    D = Gc[..., :, None] - Gc[..., None, :]  # G_t - G_s
    tri = torch.ones(C, C, dtype=torch.bool, device=dev)
    ninf = torch.tensor(float("-inf"), dtype=cdt, device=dev)
    strict = torch.exp(torch.where(tri.tril(-1), D, ninf))
    incl = torch.exp(torch.where(tri.tril(), D, ninf))
    Kt = K.transpose(-1, -2)
    A = Bt[..., :, None] * (K @ Kt) * strict
    L = A + torch.eye(C, dtype=cdt, device=dev)
    gam = torch.exp(Gc)
    W = torch.linalg.solve_triangular(L, (Bt * gam)[..., None] * K, upper=False, unitriangular=True)
    Ut = torch.linalg.solve_triangular(L, Bt[..., None] * V, upper=False, unitriangular=True)
    QK = (Q @ Kt) * incl  # [N, Hv, nc, C, C]
    gQ = gam[..., None] * Q
    kdecT = (torch.exp(Gc[..., -1:] - Gc)[..., None] * K).transpose(-1, -2)  # [N, Hv, nc, dk, C]
    glast = gam[..., -1, None, None]  # [N, Hv, nc, 1, 1]
    outs = []
    for c in range(nc):
        U = Ut[:, :, c] - W[:, :, c] @ S
        outs.append(scale * (gQ[:, :, c] @ S + QK[:, :, c] @ U))
        S = glast[:, :, c] * S + kdecT[:, :, c] @ U
    O = torch.stack(outs, 2).reshape(N, Hv, Lp, dv).movedim(1, 2)  # [N, Lp, Hv, dv]
    return O[valid].to(v.dtype), S
