"""The indexer on CPU: one compiled call (kernels/csrc/dsa.cpp `indexer_topk`) for the
trainer's dense forward and the engine's paged prefill, chunked prefill and decode.

A query row's scores are computed from its own indexer query and weights and its sequence's
keys at positions 0..pos, in an order fixed by the row alone (fp32: per head a fixed chain of
FMAs over d, relu, heads summed in order), and the top-k is a strict total order on (score,
position), ties to the lowest position. So the selected set of a row does not depend on how
many rows share the call, how a prompt was cut into prefill chunks, decoding, prefix-cache
hits or the thread count. The set comes back ascending and padded with -1: a canonical form
both engines, the replay record and the comparisons share.

No gradient through the selection: it is discrete (transformers' indexer runs under no_grad
too). The indexer is trained, when it is, by its own loss over the selected keys
(`index_log_probs`, models/glm_moe_dsa `indexer_loss`).
"""

from __future__ import annotations

import torch

from titan_rl.kernels.cpu_ext import ops as _ops


def key_rows(cache: torch.Tensor, block_table: torch.Tensor, seq: int, n: int) -> torch.Tensor:
    """The cache rows [n, W] of positions 0..n-1 of sequence row `seq` of the block table (a
    gather: for the plain-torch forms and the references)."""
    page = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    return cache[block_table[seq, pos // page].long(), pos % page]


def index_topk(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               row_seq: torch.Tensor, row_pos: torch.Tensor, key_off: int, scale: float, topk: int) -> torch.Tensor:
    """q [T, H, D] (the indexer's queries, model dtype), weights [T, H] (fp32 head weights),
    cache [pages, page, W] (a token's indexer key at channels key_off .. key_off + D),
    block_table [S, max_pages], row_seq / row_pos [T] (each row's sequence and absolute
    position) -> int64 [T, topk]: each row's selected positions, ascending, -1 padded."""
    return _ops().indexer_topk(q.detach(), weights.detach().float(), cache.detach(), block_table, row_seq, row_pos,
                               key_off, scale, topk)


def index_log_probs(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [T, H, D], weights [T, H], keys [T, K, D] (each row's selected keys), valid [T, K] ->
    fp32 [T, K]: log of the softmax of the index scores sum_h w_h relu(scale q_h . k_j) over
    each row's valid keys (-inf elsewhere). Plain torch, differentiable: the indexer loss's."""
    s = torch.relu(torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale)
    scores = torch.einsum("th,thk->tk", weights.float(), s)
    return torch.log_softmax(scores.masked_fill(~valid, float("-inf")), -1)
