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

from typing import Callable

import torch

from titan_rl.kernels.cpu_ext import ops as _ops
from titan_rl.kernels.matmul.blocks import padded_tree_sum


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
def attention_target(q, cache, block_table, row_seq, indices, scale: float,
                     gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """fp32 [T, K]: the attention's distribution over each row's selected keys, summed over
    heads and L1-normalised (the indexer loss's target, DeepSeek-V3.2 / GLM-5; no gradient).
    Each head's probabilities come from a call of its own and the heads are added in head
    order, so the bits do not depend on how many heads the call holds; `gather(parts [h, T,
    K]) -> [H, T, K]` joins the TP ranks' heads."""
    rows = selected_rows(cache, block_table, row_seq, indices).float()
    parts = torch.stack([_probabilities(_head(q, h), rows, indices, scale)[:, 0] for h in range(q.shape[1])])
    if gather is not None:
        parts = gather(parts)
    p = parts[0]
    for h in range(1, parts.shape[0]):
        p = p + parts[h]
    return p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)


def _head(x: torch.Tensor, h: int) -> torch.Tensor:
    """[T, 1, ...]: head h of x [T, H, ...], contiguous (its strides then do not depend on H)."""
    return x[:, h:h + 1].contiguous()


class _HeadTree(torch.autograd.Function):
    """Sparse attention whose backward does not depend on how many heads a call holds (the
    trainer with tensor-parallel pieces, tp_leaves > 0). All heads read the same cache rows
    (MLA's MQA), so the rows' gradient is a sum over heads: here each head's gradient is
    its own eager call (q, grad and the rows of that head alone), `gather` brings every
    head's partial together (TP: each rank holds its heads; None: this call holds them
    all) and a fixed tree over heads adds them, before the gather's backward (index_add,
    in index order) puts them into the cache. The forward is the form's kernel (`fast`)."""

    @staticmethod
    def forward(ctx, q, cache, block_table, row_seq, indices, scale, dv, fast, gather, tree):
        ctx.save_for_backward(q, cache, block_table, row_seq, indices)
        ctx.scale, ctx.dv, ctx.gather, ctx.tree = scale, dv, gather, tree
        return fast(q, cache, block_table, row_seq, indices, scale, dv)

    @staticmethod
    def backward(ctx, grad):
        q, cache, block_table, row_seq, indices = ctx.saved_tensors
        with torch.enable_grad():
            c_ = cache.detach().requires_grad_()
            gathered = selected_rows(c_, block_table, row_seq, indices)
            rows = gathered.detach().float().requires_grad_()
            gq, parts = [], []
            for h in range(q.shape[1]):
                q_ = _head(q, h).detach().requires_grad_()
                p = _probabilities(q_, rows, indices, ctx.scale)
                o = torch.einsum("thk,tkd->thd", p, rows[..., :ctx.dv]).to(q.dtype)
                g_q, g_rows = torch.autograd.grad(o, (q_, rows), _head(grad, h).to(o.dtype))
                gq.append(g_q)
                parts.append(g_rows)
            parts = torch.stack(parts)
            if ctx.gather is not None:
                parts = ctx.gather(parts)
            g_rows = padded_tree_sum(parts, ctx.tree).to(gathered.dtype)
            gc, = torch.autograd.grad(gathered, c_, g_rows) if ctx.needs_input_grad[1] else (None,)
        return torch.cat(gq, 1), gc, None, None, None, None, None, None, None, None


def sparse_attention_heads(q, cache, block_table, row_seq, indices, scale: float, dv: int, fast: Callable,
                           tree: Callable, gather: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """`fast(q, cache, ...)` (a form's sparse_mla_attention: the same forward bits) whose
    backward gives a head's bits whatever number of heads the call holds, the cache's
    gradient a fixed `tree` over all heads (`_HeadTree`); `gather` joins the TP ranks' heads."""
    if torch.is_grad_enabled() and (q.requires_grad or cache.requires_grad):
        return _HeadTree.apply(q, cache, block_table, row_seq, indices, scale, dv, fast, gather, tree)
    return fast(q, cache, block_table, row_seq, indices, scale, dv)


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
