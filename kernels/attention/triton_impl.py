"""Causal attention in Triton: ONE kernel for the trainer's dense forward and the engine's
paged prefill, chunked prefill and decode (a different algorithm from the CPU kernel;
docs/kernels.md).

One program per (sequence, kv head, tile of BLOCK_R query rows); a row is one (query
token, head of the kv head's group). The program reads its queries from the flat stream
and the keys/values through the block table, inside the kernel: position p of sequence s
lives in page block_table[s, p // PAGE] at offset p % PAGE, with any strides. The
trainer's dense k/v are such a cache with one page of L positions per sequence, vLLM's
GPU cache one of `block_size` positions; no gather or copy in torch.

KV is visited in blocks at ABSOLUTE positions [j*BLOCK, (j+1)*BLOCK), j = 0, 1, ..., in
two passes, all fp32 accumulation:
  1. m = the row max of all visible scores (max is exact in any order);
  2. per block p = exp(s - m), l += sum_j(p), acc += p @ V_j, strictly in block order.
Why the bits do not depend on batch, length, split or page size:
  * a row's arithmetic touches only its own q, its own position and the KV blocks at
    fixed absolute positions; the other rows of its tile only share the tl.dot
    instruction, whose per-element sum over D (scores) or BLOCK (values) has a fixed order;
  * masked positions (future, or past seq_len / uninitialised cache) get score -inf and
    value 0 (masked loads never read memory, so NaN garbage cannot leak in): p = 0 and
    their contribution is exactly 0;
  * a block entirely in the future of every row of the tile adds exactly 0, so the loop
    stops at the tile's last position without changing any row's bits.
Scores are recomputed in pass 2 instead of stored: same bits, no scratch memory.
Backward (trainer): the gradient of the same function by SDPA (kernels/autograd.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from titan_rl.kernels.autograd import with_eager_backward

BLOCK = 32  # KV positions per block, at absolute offsets
BLOCK_R = 16  # query rows per program (tl.dot needs >= 16); fixed, never from the batch


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, qsl_ptr, seqlen_ptr, bt_ptr, HKV, G, D, PAGE, scale,
                      sq_t, sq_h, sq_d, sk_b, sk_h, sk_p, sk_d, sv_b, sv_h, sv_p, sv_d, sbt, so_t, so_h, so_d,
                      BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0) // HKV
    h = tl.program_id(0) % HKV
    q_start = tl.load(qsl_ptr + s)
    qlen = tl.load(qsl_ptr + s + 1) - q_start
    kv_len = tl.load(seqlen_ptr + s)
    r0 = tl.program_id(1) * BLOCK_R
    rr = r0 + tl.arange(0, BLOCK_R)
    dd = tl.arange(0, BLOCK_D)
    bb = tl.arange(0, BLOCK)
    rmask = rr < qlen * G
    dmask = dd < D
    tok = q_start + rr // G
    head = h * G + rr % G
    qpos = tl.where(rmask, kv_len - qlen + rr // G, -1)
    q = tl.load(q_ptr + tok[:, None] * sq_t + head[:, None] * sq_h + dd[None, :] * sq_d,
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    # blocks up to the tile's last row position (later blocks would add exactly 0)
    last = tl.minimum(r0 + BLOCK_R, qlen * G) - 1
    hi = tl.where(r0 < qlen * G, kv_len - qlen + last // G + 1, 0)
    nblocks = tl.cdiv(hi, BLOCK)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for j in range(0, nblocks):  # pass 1: row max over visible scores
        kpos = j * BLOCK + bb
        in_cache = kpos < kv_len
        page = tl.load(bt_ptr + s * sbt + kpos // PAGE, mask=in_cache, other=0).to(tl.int64)
        off = kpos % PAGE
        kt = tl.load(k_ptr + page[:, None] * sk_b + h * sk_h + off[:, None] * sk_p + dd[None, :] * sk_d,
                     mask=in_cache[:, None] & dmask[None, :], other=0.0)
        sc = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale  # [BLOCK_R, BLOCK] fp32
        sc = tl.where((kpos[None, :] <= qpos[:, None]) & in_cache[None, :], sc, float("-inf"))
        m = tl.maximum(m, tl.max(sc, axis=1))
    m = tl.where(m == float("-inf"), 0.0, m)  # rows with nothing visible (masked rows)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for j in range(0, nblocks):  # pass 2: blocks summed strictly in order
        kpos = j * BLOCK + bb
        in_cache = kpos < kv_len
        kvmask = in_cache[:, None] & dmask[None, :]
        page = tl.load(bt_ptr + s * sbt + kpos // PAGE, mask=in_cache, other=0).to(tl.int64)
        off = kpos % PAGE
        kt = tl.load(k_ptr + page[:, None] * sk_b + h * sk_h + off[:, None] * sk_p + dd[None, :] * sk_d,
                     mask=kvmask, other=0.0)
        sc = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale
        sc = tl.where((kpos[None, :] <= qpos[:, None]) & in_cache[None, :], sc, float("-inf"))
        p = tl.exp(sc - m[:, None])
        vj = tl.load(v_ptr + page[:, None] * sv_b + h * sv_h + off[:, None] * sv_p + dd[None, :] * sv_d,
                     mask=kvmask, other=0.0)
        l = l + tl.sum(p, axis=1)
        acc = acc + tl.dot(p.to(vj.dtype), vj, input_precision="ieee")  # pv_j, then added
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(o_ptr + tok[:, None] * so_t + head[:, None] * so_h + dd[None, :] * so_d,
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def attention_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                 max_query_len: int | None = None) -> torch.Tensor:
    """The kernel's entry point. q [T, H, D] flat; k_cache / v_cache [num_pages, Hkv, page, D]
    (any strides); query_start_loc [S+1]; seq_lens [S] (KV length including this step's
    tokens; sequence s's queries are its last qlen positions); block_table [S, max_pages];
    max_query_len: the longest qlen (read from the tensors when None). Returns [T, H, D]
    in q's dtype (rows of no sequence are left unwritten)."""
    T, H, D = q.shape
    n_pages, hkv, page, _ = k_cache.shape
    S = seq_lens.shape[0]
    out = q.new_empty(T, H, D)
    if S == 0 or T == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    g = H // hkv
    grid = (S * hkv, triton.cdiv(max_query_len * g, BLOCK_R))
    _attention_kernel[grid](q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, hkv, g, D, page, scale,
                            *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0), *out.stride(),
                            BLOCK=BLOCK, BLOCK_R=BLOCK_R, BLOCK_D=max(16, triton.next_power_of_2(D)),
                            enable_fp_fusion=False)
    return out


def _attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    B, L, H, D = q.shape
    dev = q.device
    qsl = torch.arange(B + 1, device=dev, dtype=torch.int32) * L
    seq_lens = torch.full((B,), L, device=dev, dtype=torch.int32)
    pages = torch.arange(B, device=dev, dtype=torch.int32)[:, None]
    # k/v [B, L, Hkv, D] read in place as a cache of one L-position page per sequence.
    out = attention_kv(q.reshape(B * L, H, D), k.transpose(1, 2), v.transpose(1, 2), qsl, seq_lens, pages, scale, L)
    return out.view(B, L, H, D)


def _sdpa_causal(q, k, v, scale):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          scale=scale, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


# Trainer path. q [B, L, H, D], k/v [B, L, Hkv, D], causal from position 0.
attention_dense = with_eager_backward(_attention_dense, _sdpa_causal)


def attention_paged(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, scale: float, max_query_len: int | None = None) -> torch.Tensor:
    """Engine path, torch_impl.attention_paged's contract: flat q [T, H, D]; kv_cache
    [num_pages, Hkv, 2, page, D] (keys, values; any strides: vLLM's GPU cache is passed as
    a view, titan_rl/vllm/attention_cuda.py); query_start_loc [S+1]; seq_lens [S];
    block_table [S, max_pages]. Returns [T, H, D]."""
    return attention_kv(q, kv_cache[:, :, 0], kv_cache[:, :, 1], query_start_loc, seq_lens, block_table, scale,
                        max_query_len)


def kv_cache_write(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store key/value [n, Hkv, D] of n tokens at cache slots [n] (page * page_size +
    offset, all >= 0) of kv_cache [num_pages, Hkv, 2, page, D] (any strides)."""
    page_size = kv_cache.shape[3]
    slots = slots.long()
    pages, offs = slots // page_size, slots % page_size
    kv_cache[pages, :, 0, offs] = key.to(kv_cache.dtype)
    kv_cache[pages, :, 1, offs] = value.to(kv_cache.dtype)
