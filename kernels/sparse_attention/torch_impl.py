"""Sparse attention on CPU: one compiled call (kernels/csrc/dsa.cpp `sparse_mla_attention`)
for the trainer's dense forward and the engine's paged prefill and decode.

A row (query token, head) reads only its own query and the cache rows of its selected
positions, in ascending order: scores as fixed FMA chains, max, the polynomial exp, the sum
in 16 lanes and a tree, the value sum in position order, fp32 throughout, one rounding at
the end. Its bits depend on nothing else (not the batch, not the chunking, not the thread
count). The backward (trainer only) is the gradient of the same function in eager torch,
recomputed (`sparse_attention_eager`), as the dense attention recomputes with SDPA: the same bits
on every rerun and thread count (`selected_rows` gathers by index_select), not across batch compositions.
"""

from __future__ import annotations

import torch

from titan_rl.kernels.cpu_ext import ops as _ops


def selected_rows(cache: torch.Tensor, block_table: torch.Tensor, row_seq: torch.Tensor, indices: torch.Tensor
                  ) -> torch.Tensor:
    """[T, K, W]: the cache rows of each row's selected positions (-1 entries read position 0;
    callers mask them). By index_select, whose backward is index_add_ (rows added in index
    order): indexing's backward, index_put_ with accumulate, summed the many queries' gradients
    of a shared key in an order that changed with the thread count (GLM-5's training step
    differed at 1 and 2 threads: tests/test_invariance_guard.py, test_glm5_kernels.py)."""
    P, page, W = cache.shape
    pos = indices.clamp(min=0)
    slot = block_table.long()[row_seq.long()[:, None], pos // page] * page + pos % page
    return cache.reshape(P * page, W).index_select(0, slot.reshape(-1)).view(*slot.shape, W)


def _probabilities(q, rows, indices, scale: float) -> torch.Tensor:
    """fp32 [T, H, K]: each head's softmax over its row's selected keys (0 at -1 entries)."""
    s = torch.einsum("thd,tkd->thk", q.float(), rows[..., : q.shape[-1]]) * scale
    valid = (indices >= 0)[:, None, :]
    return torch.softmax(s.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0)  # a row with no key: zeros


def sparse_attention_eager(q, cache, block_table, row_seq, indices, scale: float, dv: int) -> torch.Tensor:
    """The same function in plain torch (fp32): the backward's, and the stock mode's."""
    rows = selected_rows(cache, block_table, row_seq, indices).float()
    p = _probabilities(q, rows, indices, scale)
    return torch.einsum("thk,tkd->thd", p, rows[..., :dv]).to(q.dtype)


@torch.no_grad()
def attention_target(q, cache, block_table, row_seq, indices, scale: float) -> torch.Tensor:
    """fp32 [T, K]: the attention's distribution over each row's selected keys, summed over
    heads and L1-normalised (the indexer loss's target, DeepSeek-V3.2 / GLM-5; no gradient)."""
    p = _probabilities(q, selected_rows(cache, block_table, row_seq, indices).float(), indices, scale).sum(1)
    return p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cache, block_table, row_seq, indices, scale, dv):
        ctx.save_for_backward(q, cache, block_table, row_seq, indices)
        ctx.scale, ctx.dv = scale, dv
        return _ops().sparse_mla_attention(q, cache, block_table, row_seq, indices, scale, dv)

    @staticmethod
    def backward(ctx, grad):
        q, cache, block_table, row_seq, indices = ctx.saved_tensors
        with torch.enable_grad():
            q_, c_ = q.detach().requires_grad_(), cache.detach().requires_grad_()
            o = sparse_attention_eager(q_, c_, block_table, row_seq, indices, ctx.scale, ctx.dv)
            gq, gc = torch.autograd.grad(o, (q_, c_), grad)
        return gq, gc, None, None, None, None, None


def sparse_mla_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, row_seq: torch.Tensor,
                         indices: torch.Tensor, scale: float, dv: int) -> torch.Tensor:
    """q [T, H, Dq] -> [T, H, dv]: row t attends to positions indices[t] (ascending, -1
    padded) of sequence row_seq[t]; a position's key is the first Dq channels of its cache
    row ([pages, page, W] through block_table), its value the first dv (MLA's latent)."""
    if torch.is_grad_enabled() and (q.requires_grad or cache.requires_grad):
        return _SparseAttention.apply(q, cache, block_table, row_seq, indices, scale, dv)
    return _ops().sparse_mla_attention(q, cache, block_table, row_seq, indices, scale, dv)
