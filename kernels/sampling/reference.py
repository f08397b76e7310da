"""Plain per-row top-k / top-p, for tests: one row at a time, thresholds and the top-p
cut decided by Python loops. Same fp32 softmax and cumsum of the sorted row as the
batched version (the cut compares those floats, so the test can demand equality)."""

from __future__ import annotations

import torch


def kept_row_reference(row: torch.Tensor, k: int | None, p: float | None) -> torch.Tensor:
    """row [V] fp32 -> bool [V] kept."""
    V = row.numel()
    vals, idx = row.float().sort(stable=True)
    vals = vals.clone()
    vals_list = vals.tolist()
    if k is not None and 0 < k < V:
        thr = vals_list[V - k]
        for j in range(V):
            if vals_list[j] < thr:
                vals[j] = float("-inf")
    dropped = [v == float("-inf") for v in vals.tolist()]
    if p is not None and p < 1:
        cum = torch.softmax(vals, dim=-1).cumsum(dim=-1).tolist()
        limit = (1 - torch.tensor(p, dtype=torch.float32)).item()  # fp32 1 - p, as vLLM
        for j in range(V - 1):  # the last (largest) is always kept
            if cum[j] <= limit:
                dropped[j] = True
    kept = torch.zeros(V, dtype=torch.bool)
    for j in range(V):
        if not dropped[j] and vals_list[j] != float("-inf"):
            kept[int(idx[j])] = True
    return kept


def kept_mask_reference(logits: torch.Tensor, k, p) -> torch.Tensor:
    N = logits.shape[0]
    ks = [None] * N if k is None else [int(x) for x in torch.as_tensor(k).reshape(-1).expand(N)]
    ps = [None] * N if p is None else [float(x) for x in torch.as_tensor(p, dtype=torch.float32).reshape(-1).expand(N)]
    return torch.stack([kept_row_reference(logits[i], ks[i], ps[i]) for i in range(N)])


def sampled_logprobs_reference(logits, tokens, temperature, top_k=None, top_p=None) -> torch.Tensor:
    """fp32, row by row: scale, mask, log-softmax, gather."""
    N = logits.shape[0]
    t = torch.as_tensor(temperature, dtype=torch.float32).reshape(-1).expand(N)
    out = []
    for i in range(N):
        scaled = logits[i] / t[i]
        kept = kept_mask_reference(scaled[None], None if top_k is None else torch.as_tensor(top_k).reshape(-1).expand(N)[i],
                                   None if top_p is None else torch.as_tensor(top_p).reshape(-1).expand(N)[i])[0]
        masked = scaled.masked_fill(~kept, float("-inf"))
        out.append(masked.log_softmax(-1, dtype=torch.float32)[int(tokens[i])])
    return torch.stack(out)
