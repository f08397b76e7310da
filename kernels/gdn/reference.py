"""Reference gated delta rule and causal conv: plain per-sequence, per-token Python loops
in float64 (slow, obviously right, no invariance claim; differentiable by autograd)."""

from __future__ import annotations

import torch


def gdn_reference(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None):
    """Same signature as gdn_recurrent. Returns (o [T, Hv, dv], final_state [N, Hv, dk, dv]),
    both float64. For token t of a sequence, per head (v head h reads q/k head h // (Hv/Hk)):
    S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = scale S^T q_t."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    if scale is None:
        scale = dk ** -0.5
    rep = Hv // Hk
    q, k = (x.double().repeat_interleave(rep, dim=1) for x in (q, k))
    v, g, beta = v.double(), g.double(), beta.double()
    cu = [int(c) for c in cu_seqlens]
    outs, finals = [], []
    for i in range(len(cu) - 1):
        S = (initial_state[i].double() if initial_state is not None
             else torch.zeros(Hv, dk, dv, dtype=torch.float64, device=v.device))
        for t in range(cu[i], cu[i + 1]):
            S = torch.exp(g[t])[:, None, None] * S
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * u[:, None, :]
            outs.append(scale * torch.einsum("hkv,hk->hv", S, q[t]))
        finals.append(S)
    o = torch.stack(outs) if outs else v.new_zeros(0, Hv, dv)
    return o, torch.stack(finals)


def causal_conv1d_reference(x, weight, cu_seqlens, initial_state=None):
    """Same signature as causal_conv1d; float64 loop over sequences, tokens and taps.
    Returns (y [T, C], final_state [N, C, K-1]), both float64."""
    if weight.dim() == 3:
        weight = weight[:, 0]
    T, C = x.shape
    K = weight.shape[-1]
    w = weight.double()
    cu = [int(c) for c in cu_seqlens]
    ys, finals = [], []
    for i in range(len(cu) - 1):
        hist = ([initial_state[i, :, j].double() for j in range(K - 1)] if initial_state is not None
                else [torch.zeros(C, dtype=torch.float64) for _ in range(K - 1)])
        for t in range(cu[i], cu[i + 1]):
            hist = hist + [x[t].double()]
            y = torch.zeros(C, dtype=torch.float64)
            for j in range(K):
                y = y + w[:, j] * hist[len(hist) - K + j]
            ys.append(y)
        last = hist[len(hist) - (K - 1):] if K > 1 else []
        finals.append(torch.stack(last, -1) if last else torch.zeros(C, 0, dtype=torch.float64))
    y = torch.stack(ys) if ys else torch.zeros(0, C, dtype=torch.float64)
    return y, torch.stack(finals)
