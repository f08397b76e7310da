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
values ([page, D]); the bf16 forms store both in pairs (keys [D/2, page, 2], values
[page/2, D, 2]: what one bf16 dot-product instruction reads is one cache line, and the tile
operand layout the amx form loads). The trainer's dense keys and values go in as a copy in
pages of DENSE_PAGE positions, in the layout of the form.

Three forms for bf16 queries and caches, chosen once per platform (`ATTN_FORM`, reported by
the self-check and the execution contract): "amx" where the CPU has AMX-BF16 (scores and the
value sum by tile dot products, tdpbf16ps, whose per-output sums are spelled out in
reference.attention_amx_form; ~2.7x the dpbf16 form's speed at 4096 tokens), "dpbf16" where it
has AVX512-BF16 (the same passes by the vector bf16 dot product), else "fp32" (bf16 operands
widened, fp32 FMAs). The bf16 forms round the softmax weights to bf16 for the value sum, as
flash attention does, and share the cache's pair layout. fp32 models always run the fp32 form.
Each form has its own bits; trainer and engine call the same form, so they agree bit for bit.

The backward (trainer only) is the gradient of the same function computed by torch's SDPA
flash backward from the kernel's output and its rows' log-sum-exps (`paged_attention_lse`):
only the forward has to match the engine bit for bit.
"""

import torch

from titan_rl.kernels.cpu_ext import ops as _ops


LANES = 16  # the kernel's block of positions; pages and the dense key copy are multiples of it


def _dpbf16_available() -> bool:
    try:
        return bool(_ops().paged_attention_dpbf16_available())
    except (RuntimeError, OSError):
        return False


def _amx_available() -> bool:
    try:
        return bool(_ops().paged_attention_amx_available())
    except (RuntimeError, OSError):
        return False


ATTN_FORM = "amx" if _amx_available() else "dpbf16" if _dpbf16_available() else "fp32"
PAIR_FORMS = ("dpbf16", "amx")  # the forms whose cache is in the pair layout


def _dots(dtype: torch.dtype, head_dim: int) -> bool:
    """A pair-layout form for this cache: its writer (pair layout) and its reader agree on it."""
    return ATTN_FORM in PAIR_FORMS and dtype == torch.bfloat16 and head_dim <= 256


def _form(dots: bool) -> str:
    """The kernel's form for a cache whose layout `_dots` chose."""
    return ATTN_FORM if dots else "fp32"


DENSE_PAGE = 64  # positions per page of the trainer's copy (a multiple of LANES)


def _dense_forward(q, k, v, scale, with_lse: bool = False):
    """The trainer's keys and values copied into pages of DENSE_PAGE positions: one page
    per sequence would put the rows of a transposed key block L * 2-4 bytes apart, a
    power-of-two stride at the usual lengths, where every row lands in the same cache set
    (measured: the bf16 form at L = 2048 ran at half its paged speed). The row's bits do
    not depend on the page size (pages are multiples of the kernel's position block)."""
    B, L, H, D = q.shape
    hkv, dev = k.shape[2], q.device
    n_pages = -(-L // DENSE_PAGE)
    Lp = n_pages * DENSE_PAGE
    if Lp != L:
        k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, Lp - L)) for t in (k, v))
    P, dots = DENSE_PAGE, _dots(k.dtype, D) and q.dtype == torch.bfloat16
    if dots:  # the pair layout (kv_cache_write): keys [D/2, page, 2], values [page/2, D, 2]
        kt = k.reshape(B, n_pages, P, hkv, D // 2, 2).permute(0, 1, 3, 4, 2, 5).contiguous().view(B * n_pages, hkv, D, P)
        vv = v.reshape(B, n_pages, P // 2, 2, hkv, D).permute(0, 1, 4, 2, 5, 3).contiguous().view(B * n_pages, hkv, P, D)
    else:  # keys transposed [D, page], values [page, D]
        kt = k.reshape(B, n_pages, P, hkv, D).permute(0, 1, 3, 4, 2).contiguous().view(B * n_pages, hkv, D, P)
        vv = v.reshape(B, n_pages, P, hkv, D).permute(0, 1, 3, 2, 4).reshape(B * n_pages, hkv, P, D)
    qsl = torch.arange(B + 1, device=dev) * L
    seq_lens = torch.full((B,), L, device=dev, dtype=torch.long)
    pages = torch.arange(B * n_pages, device=dev).view(B, n_pages)
    if with_lse:  # and each row's log-sum-exp [B, L, H] (fp32), for the backward
        out, lse = _ops().paged_attention_lse(q.reshape(B * L, H, D), kt, vv, qsl, seq_lens, pages, scale, _form(dots))
        return out.view(B, L, H, D), lse.view(B, L, H)
    out = _ops().paged_attention(q.reshape(B * L, H, D), kt, vv, qsl, seq_lens, pages, scale, _form(dots))
    return out.view(B, L, H, D)


class _DenseAttention(torch.autograd.Function):
    """The kernel's forward; the backward is SDPA's CPU flash backward given the kernel's own
    output and row log-sum-exps (the gradient of the same function, without the forward SDPA's
    autograd would recompute)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = _dense_forward(q, k, v, scale, with_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
            lse.transpose(1, 2).contiguous(), 0.0, True, scale=ctx.scale)
        return gq.transpose(1, 2), gk.transpose(1, 2), gv.transpose(1, 2), None


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
    offset; a negative slot, vLLM's padding token, is skipped) in the layout attention_paged
    reads; kv_cache contiguous (vLLM's per-layer cache is)."""
    _ops().kv_cache_write(kv_cache, key, value, slots, _dots(kv_cache.dtype, kv_cache.shape[-1]))


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
    dots = _dots(kv_cache.dtype, kv_cache.shape[-1])
    if dots and q.dtype != torch.bfloat16:
        raise TypeError(f"attention_paged: a bfloat16 cache in the bf16 form takes bfloat16 queries; got {q.dtype}")
    return _ops().paged_attention(q, kt, vv, query_start_loc, seq_lens, block_table, scale, _form(dots))
