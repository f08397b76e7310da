"""Reference sparse attention: the plain definition in fp64, one row at a time."""

from __future__ import annotations

import torch

from titan_rl.kernels.indexer.reference import key_rows


def sparse_attention_reference(q, cache, block_table, row_seq, indices, scale: float, dv: int) -> torch.Tensor:
    """q [T, H, Dq]; row t attends to the positions indices[t] (-1 = none) of its sequence:
    keys are the first Dq channels of a cache row, values the first dv. fp64, cast to q's dtype."""
    T, H, Dq = q.shape
    out = torch.zeros(T, H, dv, dtype=torch.float64)
    for t in range(T):
        sel = [int(j) for j in indices[t] if int(j) >= 0]
        if not sel:
            continue
        rows = key_rows(cache, block_table, int(row_seq[t]), max(sel) + 1)[sel].double()
        p = torch.softmax((q[t].double() @ rows[:, :Dq].t()) * scale, -1)  # [H, n]
        out[t] = p @ rows[:, :dv]
    return out.to(q.dtype)
