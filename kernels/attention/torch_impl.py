"""Causal attention on CPU: one compiled kernel (kernels/csrc/paged_attention.cpp) for the
trainer's dense forward and the engine's paged prefill, chunked prefill and decode.

Each (query token, head) row is computed from its own query and its sequence's keys and
values at positions 0..pos, in an order fixed by pos alone (fp32 throughout: scores as
in-order sums over D, max, a polynomial exp, sums in position order), so a row's bits do
not depend on how many rows, sequences or prefill chunks share the call, nor on the
thread count. The kernel reads keys and values in place through a page table.

The cache layout is ours (`kv_cache_write` is the one writer): vLLM's CPU cache
[pages, Hkv, 2, page, D] holds, per page and kv head, the keys TRANSPOSED ([D, page]:
the scores of 16 consecutive positions are one vector operation per d) and then the
values ([page, D]). The trainer's dense keys go in as a transposed copy (one page per
sequence), its values as a view.

The backward (trainer only) is the gradient of the same function computed by torch's
SDPA: only the forward has to match the engine bit for bit.
"""

import torch

from titan_rl.kernels.cpu_ext import ops as _ops


LANES = 16  # the kernel's block of positions; pages and the dense key copy are multiples of it


def _dense_forward(q, k, v, scale):
    B, L, H, D = q.shape
    hkv, dev = k.shape[2], q.device
    Lp = -(-L // LANES) * LANES
    kt = k.new_zeros(B, hkv, D, Lp)
    kt[..., :L] = k.permute(0, 2, 3, 1)
    qsl = torch.arange(B + 1, device=dev) * L
    seq_lens = torch.full((B,), L, device=dev, dtype=torch.long)
    pages = torch.arange(B, device=dev)[:, None]
    out = _ops().paged_attention(q.reshape(B * L, H, D), kt, v.transpose(1, 2), qsl, seq_lens, pages, scale)
    return out.view(B, L, H, D)


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return _dense_forward(q, k, v, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(
                q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), is_causal=True, scale=ctx.scale,
                enable_gqa=q.shape[2] != k.shape[2],
            ).transpose(1, 2)
            gq, gk, gv = torch.autograd.grad(o, (q_, k_, v_), grad)
        return gq, gk, gv, None


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Trainer path. q [B, L, H, D], k/v [B, L, Hkv, D], sequences start at position 0,
    causal. Right padding is harmless (a row never sees later positions)."""
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _DenseAttention.apply(q, k, v, scale)
    return _dense_forward(q, k, v, scale)


def _halves(kv_cache: torch.Tensor):
    """[pages, Hkv, 2, page, D] -> keys [pages, Hkv, D, page] (transposed), values
    [pages, Hkv, page, D]: views of the same memory."""
    n_pages, hkv, _, page, d = kv_cache.shape
    return kv_cache[:, :, 0].flatten(-2).unflatten(-1, (d, page)), kv_cache[:, :, 1]


def kv_cache_write(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store key/value [n, Hkv, D] of n tokens at cache slots [n] (page * page_size +
    offset; all >= 0) in the layout attention_paged reads; kv_cache contiguous (vLLM's
    per-layer cache is)."""
    _ops().kv_cache_write(kv_cache, key, value, slots)


def attention_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Engine path over a paged KV cache, prefills and decodes mixed in one flat stream.

    q [T, H, D] (flat); kv_cache [num_pages, Hkv, 2, page, D] written by
    `kv_cache_write`; query_start_loc [S+1]; seq_lens [S] (KV length including this
    step's tokens); block_table [S, max_pages]. The queries of sequence s are its last
    (qlen) positions. Returns [T, H, D]."""
    if seq_lens.shape[0] == 0:
        return q.new_empty(q.shape)
    kt, vv = _halves(kv_cache)
    return _ops().paged_attention(q, kt, vv, query_start_loc, seq_lens, block_table, scale)
