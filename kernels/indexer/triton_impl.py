"""The lightning indexer in Triton: torch_impl.index_topk's contract (each query row's min(topk,
pos + 1) positions of the largest scores, ties to the LOWEST position, ascending, -1 padded).

Two kernels:
  1. scores: one program per (query row, block of BLOCK_N key positions at absolute offsets
     j*BLOCK_N). Keys come through the block table inside the kernel (position p of sequence s:
     page block_table[s, p // PAGE], offset p % PAGE, any strides); the program computes
     s[h, p] = q_h . k_p for all heads at once with one fp32 tl.dot (IEEE, not TF32), then
     I_p = sum_h w_h * relu(scale * s[h, p]) with a tl.sum over a fixed BLOCK_H lanes. It
     stores each score as an order-preserving int32 key (larger score, larger key; -0 and +0
     one key; NaN below every number), into a scratch row [T, n_max].
  2. selection: one program per query row. The k-th largest key is found by a search over the
     2^32 key values (8 passes, each counting the keys >= 16 candidates; integer counts, exact),
     then one pass in ascending position order keeps every key above it and the lowest-
     positioned keys equal to it until k are kept, writing them in that order. That is the
     strict total order on (score, position) of the CPU kernel: the selected set is unique, so
     no choice is left to thread scheduling or to a sort's tie handling.
Why a row's result does not depend on the batch: a program reads only its own row's query,
weights and sequence's keys; tile shapes (BLOCK_N, BLOCK_H = next_power_of_2(max(H, 16)),
BLOCK_D = next_power_of_2(max(D, 16))) depend on the model's H and D, never on the number of
rows; positions past the row's own are masked loads that are never used. The scores' summation
order (the tl.dot's over d, the head sum's tree) is not the CPU kernel's FMA chains: the two
backends pick the same top-k of the fp64 scores up to an fp32 rounding, not bit for bit.
No gradient (a discrete selection), as torch_impl.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # key positions per score program, at absolute offsets
BLOCK_S = 128  # key positions per step of the selection's passes


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, c_ptr, bt_ptr, seq_ptr, pos_ptr, key_ptr, H, D, PAGE, key_off, scale,
                         sq_t, sq_h, sq_d, sw_t, sw_h, sc_p, sc_r, sc_c, sbt, sk_t,
                         BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    jj = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    hh = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    seq = tl.load(seq_ptr + r).to(tl.int64)
    pos = tl.load(pos_ptr + r)
    visible = jj <= pos
    page = tl.load(bt_ptr + seq * sbt + jj // PAGE, mask=visible, other=0).to(tl.int64)
    k = tl.load(c_ptr + page[:, None] * sc_p + (jj % PAGE)[:, None] * sc_r + (key_off + dd)[None, :] * sc_c,
                mask=visible[:, None] & (dd < D)[None, :], other=0.0).to(tl.float32)
    q = tl.load(q_ptr + r * sq_t + hh[:, None] * sq_h + dd[None, :] * sq_d,
                mask=(hh < H)[:, None] & (dd < D)[None, :], other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_N]
    s = tl.where(s > 0.0, s, 0.0)  # relu; a NaN product also gives 0, as the CPU kernel's
    w = tl.load(w_ptr + r * sw_t + hh * sw_h, mask=hh < H, other=0.0).to(tl.float32)
    score = tl.sum(w[:, None] * s, axis=0)  # padded heads add w = 0 times s = 0
    score = tl.where(score == 0.0, 0.0, score)  # -0 and +0: one key
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: reverse their magnitude order
    key = tl.where(score != score, -2147483648, key)  # NaN: the lowest key
    tl.store(key_ptr + r * sk_t + jj, key, mask=visible)


@triton.jit
def _select_kernel(key_ptr, pos_ptr, out_ptr, TOPK, sk_t, so_t, BLOCK_S: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(pos_ptr + r) + 1
    k = tl.minimum(n, TOPK)
    bb = tl.arange(0, BLOCK_S)
    # the threshold t: the largest key value with #(key >= t) >= k, so #(key > t) < k. A search
    # over the int32 range [lo, lo + span), 16 candidates per pass (4 bits), 8 passes.
    cc = tl.arange(0, 16)
    lo = tl.full((), -2147483648, tl.int64)
    span = tl.full((), 4294967296, tl.int64)
    for _ in range(0, 8):
        span = span >> 4
        cand = lo + cc.to(tl.int64) * span  # cand[0] = lo: #(key >= lo) >= k holds already
        cnt = tl.zeros((16,), tl.int32)
        for j0 in range(0, n, BLOCK_S):
            jj = j0 + bb
            key = tl.load(key_ptr + r * sk_t + jj, mask=jj < n, other=-2147483648).to(tl.int64)
            cnt += tl.sum(((key[None, :] >= cand[:, None]) & (jj < n)[None, :]).to(tl.int32), axis=1)
        lo = lo + tl.max(tl.where(cnt >= k, cc, 0), axis=0).to(tl.int64) * span  # counts fall with the candidate
    above = tl.zeros((), tl.int64)
    for j0 in range(0, n, BLOCK_S):
        jj = j0 + bb
        key = tl.load(key_ptr + r * sk_t + jj, mask=jj < n, other=0).to(tl.int64)
        above += tl.sum(((key > lo) & (jj < n)).to(tl.int64), axis=0)
    need = k - above  # keys equal to the threshold to keep, lowest positions first
    kept = tl.zeros((), tl.int64)
    ties = tl.zeros((), tl.int64)
    for j0 in range(0, n, BLOCK_S):
        jj = j0 + bb
        live = jj < n
        key = tl.load(key_ptr + r * sk_t + jj, mask=live, other=0).to(tl.int64)
        tie = (key == lo) & live
        tie_rank = ties + tl.cumsum(tie.to(tl.int64), axis=0) - 1
        keep = ((key > lo) & live) | (tie & (tie_rank < need))
        slot = kept + tl.cumsum(keep.to(tl.int64), axis=0) - 1
        tl.store(out_ptr + r * so_t + slot, jj.to(tl.int64), mask=keep)
        kept += tl.sum(keep.to(tl.int64), axis=0)
        ties += tl.sum(tie.to(tl.int64), axis=0)
    for j0 in range(0, TOPK, BLOCK_S):  # the slots past k: -1 (never a slot written above)
        jj = j0 + bb
        tl.store(out_ptr + r * so_t + jj, tl.full((BLOCK_S,), -1, tl.int64), mask=(jj >= k) & (jj < TOPK))


def index_topk(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               row_seq: torch.Tensor, row_pos: torch.Tensor, key_off: int, scale: float, topk: int) -> torch.Tensor:
    """torch_impl.index_topk's contract: q [T, H, D], weights [T, H], cache [pages, page, W]
    (a position's indexer key at channels key_off .. key_off + D), block_table [S, max_pages],
    row_seq / row_pos [T] -> int64 [T, topk], each row's selected positions ascending, -1 padded."""
    if q.dim() != 3 or weights.shape != q.shape[:2]:
        raise ValueError(f"index_topk: q [T, H, D] and weights [T, H], got {tuple(q.shape)}, {tuple(weights.shape)}")
    if topk < 1:
        raise ValueError(f"index_topk: topk = {topk} must be >= 1")
    T, H, D = q.shape
    if cache.dim() != 3 or key_off < 0 or key_off + D > cache.shape[2]:
        raise ValueError(f"index_topk: key channels {key_off}..{key_off + D} past the cache row {tuple(cache.shape)}")
    out = torch.empty(T, topk, dtype=torch.long, device=q.device)
    if T == 0:
        return out
    q, w = q.detach(), weights.detach().float()
    bt = block_table.to(torch.long).contiguous()
    seq, pos = row_seq.to(torch.long).contiguous(), row_pos.to(torch.long).contiguous()
    # a row reads positions 0..pos: every page it touches must be in its block-table row and in
    # the cache (the kernel reads what the table says; a wrong row must fail here, not read
    # outside the cache)
    page = cache.shape[1]
    if bool((seq < 0).any() | (seq >= bt.shape[0]).any() | (pos < 0).any() | (pos // page >= bt.shape[1]).any()):
        raise ValueError("index_topk: a row names a sequence or position outside the block table")
    pages = bt[seq]
    touched = torch.arange(bt.shape[1], device=bt.device)[None, :] <= (pos // page)[:, None]
    if bool((touched & ((pages < 0) | (pages >= cache.shape[0]))).any()):
        raise ValueError(f"index_topk: a row reads a page outside the cache's {cache.shape[0]}")
    n_max = int(pos.max()) + 1
    keys = torch.empty(T, n_max, dtype=torch.int32, device=q.device)
    BLOCK_H = triton.next_power_of_2(max(H, 16))
    BLOCK_D = triton.next_power_of_2(max(D, 16))
    _index_scores_kernel[(T, triton.cdiv(n_max, BLOCK_N))](
        q, w, cache.detach(), bt, seq, pos, keys, H, D, page, key_off, float(scale),
        q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), cache.stride(0), cache.stride(1),
        cache.stride(2), bt.stride(0), keys.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, enable_fp_fusion=False)
    _select_kernel[(T,)](keys, pos, out, topk, keys.stride(0), out.stride(0), BLOCK_S=BLOCK_S)
    return out
