"""Reference MoE routing and expert combination: a plain per-token loop.

Obviously right, slow, no invariance claim; tests compare torch_impl against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def router_topk_reference(hidden, gate_weight, k: int, norm_topk_prob: bool):
    """fp32 softmax over fp64 router logits (rounded to fp32), top-k by (-prob, index)."""
    logits = (hidden.double() @ gate_weight.double().t()).float()
    probs = torch.softmax(logits, -1)
    T = hidden.shape[0]
    weights = torch.empty(T, k, dtype=torch.float32)
    ids = torch.empty(T, k, dtype=torch.long)
    for t in range(T):
        row = probs[t].tolist()
        order = sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]
        w = [row[e] for e in order]
        if norm_topk_prob:
            s = sum(w)
            w = [v / s for v in w]
        weights[t] = torch.tensor(w, dtype=torch.float32)
        ids[t] = torch.tensor(order)
    return weights, ids


def moe_experts_reference(x, ids, weights, w_gate, w_up, w_down):
    """out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), in fp64, cast to x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(w_gate[e].double() @ xt) * (w_up[e].double() @ xt)
            out[t] += float(weights[t, j]) * (w_down[e].double() @ h)
    return out.to(x.dtype)
