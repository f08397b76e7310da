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


def router_sigmoid_reference(hidden, gate_weight, bias, k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                             scaling: float):
    """DeepSeek-V3 / GLM-5 routing per token in fp64: sigmoid scores, choice by score + bias
    within the topk_group best groups (a group's score: its top-2 sum), ties to the lowest
    index; weights = chosen scores (renormalised) x scaling. Returns (weights fp64, ids)."""
    scores = torch.sigmoid(hidden.double() @ gate_weight.double().t())
    choice = scores + bias.double()
    T, E = scores.shape
    per = E // n_group
    weights = torch.empty(T, k, dtype=torch.float64)
    ids = torch.empty(T, k, dtype=torch.long)
    for t in range(T):
        row = choice[t].tolist()
        gs = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-gs[g], g))[:topk_group]
        allowed = [e for e in range(E) if e // per in groups]
        order = sorted(allowed, key=lambda e: (-row[e], e))[:k]
        w = [float(scores[t, e]) for e in order]
        if norm_topk_prob:
            s = sum(w) + 1e-20
            w = [v / s for v in w]
        weights[t] = torch.tensor(w, dtype=torch.float64) * scaling
        ids[t] = torch.tensor(order)
    return weights, ids
