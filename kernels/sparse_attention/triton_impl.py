"""Sparse attention in Triton: torch_impl.sparse_mla_attention's contract (each query row
attends to its selected positions only; MLA's absorbed form: keys = the first Dq channels of a
cache row, values = the first dv).

One program per (query row, tile of BLOCK_H heads, block of BLOCK_DV value channels). The row's
index list is visited in blocks of BLOCK_N entries in list order (ascending positions, -1
padding last); each entry's cache row is read through the block table inside the kernel (any
strides). Two passes, fp32 throughout:
  1. m = the max of the row's scores s = scale * q . k (tl.dot over Dq in chunks of BLOCK_D,
     in chunk order, IEEE fp32, not TF32; max is exact in any order);
  2. per block, in list order: p = exp(s - m), l += sum(p), acc += p @ V (tl.dot, IEEE fp32);
  out = acc / l, rounded once to q's dtype; a row with no selected position gives zeros.
Why a row's bits do not depend on the batch: the program reads only its own query, index list
and the cache rows it names; tile shapes are constants (BLOCK_N, BLOCK_D, BLOCK_DV, BLOCK_H),
never functions of the number of rows; -1 entries (and channels past Dq / dv) are masked loads:
score -inf, value 0, so they add exactly 0. The scores are recomputed in pass 2 (and by each
value-channel block) the same way, so every program sees the same p. The summation orders are
not the CPU kernel's: the two backends agree to the stated tolerance, not bit for bit.
Backward (trainer): the gradient of torch_impl.sparse_attention_eager (kernels/autograd.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_rl.kernels.autograd import with_eager_backward
from titan_rl.kernels.sparse_attention.torch_impl import sparse_attention_eager

BLOCK_N = 32  # selected positions per block of the index list
BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows)
BLOCK_D = 64  # key channels per step of the score's dot
BLOCK_DV = 64  # value channels per program


@triton.jit
def _scores(q_ptr, c_ptr, t, hh, page, off, valid, H, DQ, scale, sq_t, sq_h, sq_d, sc_p, sc_r, sc_c,
            BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    dd = tl.arange(0, BLOCK_D)
    s = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
    for d0 in range(0, DQ, BLOCK_D):  # chunks of the key channels, in order
        d = d0 + dd
        q = tl.load(q_ptr + t * sq_t + hh[:, None] * sq_h + d[None, :] * sq_d,
                    mask=(hh < H)[:, None] & (d < DQ)[None, :], other=0.0).to(tl.float32)
        k = tl.load(c_ptr + page[:, None] * sc_p + off[:, None] * sc_r + d[None, :] * sc_c,
                    mask=valid[:, None] & (d < DQ)[None, :], other=0.0).to(tl.float32)
        s += tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.where(valid[None, :], s * scale, float("-inf"))


@triton.jit
def _sparse_attention_kernel(q_ptr, c_ptr, bt_ptr, seq_ptr, ind_ptr, o_ptr, H, DQ, DV, K, PAGE, scale,
                             sq_t, sq_h, sq_d, sc_p, sc_r, sc_c, sbt, si_t, so_t, so_h, so_d,
                             BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_DV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    vv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    bb = tl.arange(0, BLOCK_N)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for j0 in range(0, K, BLOCK_N):  # pass 1: the row max (exact in any order)
        idx = tl.load(ind_ptr + t * si_t + j0 + bb, mask=j0 + bb < K, other=-1)
        valid = idx >= 0
        page = tl.load(bt_ptr + seq * sbt + idx // PAGE, mask=valid, other=0).to(tl.int64)
        s = _scores(q_ptr, c_ptr, t, hh, page, idx % PAGE, valid, H, DQ, scale, sq_t, sq_h, sq_d, sc_p, sc_r, sc_c,
                    BLOCK_N, BLOCK_H, BLOCK_D)
        m = tl.maximum(m, tl.max(s, axis=1))
    m = tl.where(m == float("-inf"), 0.0, m)  # no position selected: p = 0 below
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    for j0 in range(0, K, BLOCK_N):  # pass 2: blocks strictly in list order
        idx = tl.load(ind_ptr + t * si_t + j0 + bb, mask=j0 + bb < K, other=-1)
        valid = idx >= 0
        page = tl.load(bt_ptr + seq * sbt + idx // PAGE, mask=valid, other=0).to(tl.int64)
        off = idx % PAGE
        s = _scores(q_ptr, c_ptr, t, hh, page, off, valid, H, DQ, scale, sq_t, sq_h, sq_d, sc_p, sc_r, sc_c,
                    BLOCK_N, BLOCK_H, BLOCK_D)
        p = tl.exp(s - m[:, None])
        l += tl.sum(p, axis=1)
        v = tl.load(c_ptr + page[:, None] * sc_p + off[:, None] * sc_r + vv[None, :] * sc_c,
                    mask=valid[:, None] & (vv < DV)[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(p, v, input_precision="ieee")
    out = tl.where(l[:, None] > 0.0, tl.div_rn(acc, tl.where(l > 0.0, l, 1.0)[:, None]), 0.0)
    tl.store(o_ptr + t * so_t + hh[:, None] * so_h + vv[None, :] * so_d, out.to(o_ptr.dtype.element_ty),
             mask=(hh < H)[:, None] & (vv < DV)[None, :])


def _sparse_mla_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, row_seq: torch.Tensor,
                          indices: torch.Tensor, scale: float, dv: int) -> torch.Tensor:
    if q.dim() != 3 or indices.dim() != 2 or indices.shape[0] != q.shape[0] or row_seq.numel() != q.shape[0]:
        raise ValueError(f"sparse_mla_attention: q [T, H, Dq], indices [T, K], row_seq [T]; got {tuple(q.shape)}, "
                         f"{tuple(indices.shape)}, {tuple(row_seq.shape)}")
    T, H, Dq = q.shape
    if cache.dim() != 3 or Dq > cache.shape[2] or not 1 <= dv <= cache.shape[2]:
        raise ValueError(f"sparse_mla_attention: key / value channels ({Dq}, {dv}) past the cache row "
                         f"{tuple(cache.shape)}")
    out = torch.empty(T, H, dv, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    ind = indices.to(torch.long).contiguous()
    bt = block_table.to(torch.long).contiguous()
    seq = row_seq.to(torch.long).contiguous()
    page = cache.shape[1]
    # every selected position must lie on a page of its block-table row and of the cache (a wrong
    # replayed set must fail here, not read outside the cache)
    if bool((seq < 0).any() | (seq >= bt.shape[0]).any() | (ind // page >= bt.shape[1]).any()):
        raise ValueError("sparse_mla_attention: a row names a sequence or position outside the block table")
    pages = bt[seq[:, None], ind.clamp(min=0) // page]
    if bool(((ind >= 0) & ((pages < 0) | (pages >= cache.shape[0]))).any()):
        raise ValueError(f"sparse_mla_attention: a selected position lies on a page outside the cache's "
                         f"{cache.shape[0]}")
    grid = (T, triton.cdiv(H, BLOCK_H), triton.cdiv(dv, BLOCK_DV))
    _sparse_attention_kernel[grid](
        q, cache, bt, seq, ind, out, H, Dq, dv, ind.shape[1], page, float(scale),
        q.stride(0), q.stride(1), q.stride(2), cache.stride(0), cache.stride(1), cache.stride(2), bt.stride(0),
        ind.stride(0), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, enable_fp_fusion=False)
    return out


sparse_mla_attention = with_eager_backward(_sparse_mla_attention, sparse_attention_eager)
