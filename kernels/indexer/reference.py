"""Reference indexer: the plain definition in fp64, one row at a time (slow, obviously right,
no invariance claim). Tests compare the compiled kernel's selection against these scores."""

from __future__ import annotations

import torch

from titan_rl.kernels.indexer.torch_impl import key_rows


def index_scores_reference(q, weights, cache, block_table, row_seq, row_pos, key_off: int, scale: float
                           ) -> list[torch.Tensor]:
    """Per query row r, the fp64 scores [row_pos[r] + 1] of its sequence's positions:
    I_j = sum_h weights[r, h] * relu(scale * q[r, h] . k_j) (transformers' GlmMoeDsaIndexer)."""
    D = q.shape[-1]
    out = []
    for r in range(q.shape[0]):
        keys = key_rows(cache, block_table, int(row_seq[r]), int(row_pos[r]) + 1)[:, key_off:key_off + D].double()
        s = torch.relu((q[r].double() @ keys.t()) * scale)  # [H, n]
        out.append(weights[r].double() @ s)
    return out


def topk_reference(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The min(topk, n) positions of the largest scores, ties to the lowest position, ascending,
    padded with -1 to topk."""
    n = scores.shape[0]
    order = sorted(range(n), key=lambda j: (-float(scores[j]), j))[: min(topk, n)]
    return torch.tensor(sorted(order) + [-1] * (topk - len(order)), dtype=torch.long)
