"""Fixed-block attention in Triton (a different algorithm from the CPU kernel; docs/kernels.md).

One program per (sequence, kv head, tile of BLOCK_R query rows). KV is visited in blocks
at ABSOLUTE offsets [j*BLOCK, (j+1)*BLOCK), in order j = 0, 1, ..., in two passes, all fp32:
  1. m = the row max of all visible scores (max is exact in any order);
  2. per block p = exp(s - m), l += sum_j(p), acc += p @ V_j, strictly in block order.
Why the bits do not depend on batch, length or split:
  * a row's arithmetic touches only its own q, its own position and the KV blocks; the
    other rows of its tile only share the tl.dot instruction, whose per-element sum over
    D (scores) or BLOCK (values) has a fixed order;
  * masked positions (future, or past kv_len / uninitialised cache) get score -inf and
    value 0 (masked loads never read the memory, so NaN garbage cannot leak in), hence
    p = 0 and their contribution is exactly 0;
  * a block entirely in a row's future adds exactly 0, so the loops may stop at
    cdiv(kv_len, BLOCK) without changing any row's bits.
Scores are recomputed in pass 2 instead of stored: same bits, no scratch memory.
Row layout (GQA grouping, pad rows with position -1) and the paged-cache gather are
torch data movement (below); the arithmetic is the kernel. A production GPU kernel would
read the block table inside the program; the arithmetic would be the same.
"""

import torch
import triton
import triton.language as tl

BLOCK = 32  # KV positions per block, at absolute offsets
ROW_MULTIPLE = 8  # rows per sequence padded to this (the row layout below)

BLOCK_R = 16  # query rows per program (tl.dot needs >= 16); fixed, never from R


def _to_rows(q, q_pos, hkv):
    """q [S, Q, H, D], q_pos [S, Q] -> rows [S, Hkv, R, D] (R = Q*G padded), row positions."""
    S, Q, H, D = q.shape
    g = H // hkv
    rows = q.float().view(S, Q, hkv, g, D).permute(0, 2, 1, 3, 4).reshape(S, hkv, Q * g, D)
    pos = q_pos[:, :, None].expand(S, Q, g).reshape(S, Q * g)
    pad = (-(Q * g)) % ROW_MULTIPLE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(S, hkv, pad, D)], 2)
        pos = torch.cat([pos, pos.new_full((S, pad), -1)], 1)
    return rows, pos


def _from_rows(out, S, Q, H, D, hkv, dtype):
    g = H // hkv
    out = out[:, :, : Q * g].reshape(S, hkv, Q, g, D).permute(0, 2, 1, 3, 4)
    return out.reshape(S, Q, H, D).to(dtype)



@triton.jit
def _blocked_core_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, kvlen_ptr, o_ptr, HKV, R, D, scale,
                         sq_s, sq_h, sq_r, sq_d, sk_s, sk_h, sk_p, sk_d, sv_s, sv_h, sv_p, sv_d,
                         sp_s, sp_r, so_s, so_h, so_r, so_d,
                         BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    s = pid // HKV
    h = pid % HKV
    rr = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    dd = tl.arange(0, BLOCK_D)
    bb = tl.arange(0, BLOCK)
    rmask = rr < R
    dmask = dd < D
    q = tl.load(q_ptr + s * sq_s + h * sq_h + rr[:, None] * sq_r + dd[None, :] * sq_d,
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    qpos = tl.load(pos_ptr + s * sp_s + rr * sp_r, mask=rmask, other=-1)
    kv_len = tl.load(kvlen_ptr + s)
    nblocks = tl.cdiv(kv_len, BLOCK)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for j in range(0, nblocks):  # pass 1: row max over visible scores
        kpos = j * BLOCK + bb
        in_cache = kpos < kv_len
        kt = tl.load(k_ptr + s * sk_s + h * sk_h + kpos[:, None] * sk_p + dd[None, :] * sk_d,
                     mask=in_cache[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        sc = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale  # [BLOCK_R, BLOCK]
        sc = tl.where((kpos[None, :] <= qpos[:, None]) & in_cache[None, :], sc, float("-inf"))
        m = tl.maximum(m, tl.max(sc, axis=1))
    m = tl.where(m == float("-inf"), 0.0, m)  # rows with nothing visible (padding)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for j in range(0, nblocks):  # pass 2: blocks summed strictly in order
        kpos = j * BLOCK + bb
        in_cache = kpos < kv_len
        kvmask = in_cache[:, None] & dmask[None, :]
        kt = tl.load(k_ptr + s * sk_s + h * sk_h + kpos[:, None] * sk_p + dd[None, :] * sk_d,
                     mask=kvmask, other=0.0).to(tl.float32)
        sc = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale
        sc = tl.where((kpos[None, :] <= qpos[:, None]) & in_cache[None, :], sc, float("-inf"))
        p = tl.exp(sc - m[:, None])
        vj = tl.load(v_ptr + s * sv_s + h * sv_h + kpos[:, None] * sv_p + dd[None, :] * sv_d,
                     mask=kvmask, other=0.0).to(tl.float32)
        l = l + tl.sum(p, axis=1)
        acc = acc + tl.dot(p, vj, input_precision="ieee")  # pv_j, then added (as torch_impl)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(o_ptr + s * so_s + h * so_h + rr[:, None] * so_r + dd[None, :] * so_d, out,
             mask=rmask[:, None] & dmask[None, :])


def _blocked_core(q, k, v, q_pos, kv_len, scale):
    """q [S, Hkv, R, D] fp32; k/v [S, Hkv, P, D] position-major (any strides, any float
    dtype, P >= kv_len; torch_impl's [.., NB, BLOCK, D] flattened); q_pos [S, R] (-1 = pad
    row); kv_len [S]. Returns fp32 [S, Hkv, R, D]."""
    S, Hkv, R, D = q.shape
    out = q.new_empty(S, Hkv, R, D, dtype=torch.float32)
    if S * Hkv * R == 0:
        return out
    grid = (S * Hkv, triton.cdiv(R, BLOCK_R))
    _blocked_core_kernel[grid](q, k, v, q_pos, kv_len, out, Hkv, R, D, scale,
                               *q.stride(), *k.stride(), *v.stride(), *q_pos.stride(), *out.stride(),
                               BLOCK=BLOCK, BLOCK_R=BLOCK_R, BLOCK_D=max(16, triton.next_power_of_2(D)), enable_fp_fusion=False)
    return out


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Trainer path. q [B, L, H, D], k/v [B, L, Hkv, D], causal from position 0."""
    B, L, H, D = q.shape
    hkv = k.shape[2]
    q_pos = torch.arange(L, device=q.device).expand(B, L)
    rows, pos = _to_rows(q, q_pos, hkv)
    kv_len = torch.full((B,), L, device=q.device, dtype=torch.long)
    # k/v read in place as [B, Hkv, L, D] views: positions >= L are masked loads (no padding copy).
    out = _blocked_core(rows, k.transpose(1, 2), v.transpose(1, 2), pos.contiguous(), kv_len, scale)
    return _from_rows(out, B, L, H, D, hkv, q.dtype)


def attention_paged(q, kv_cache, query_start_loc, seq_lens, block_table, scale):
    """Engine path, same contract as torch_impl.attention_paged: flat q [T, H, D];
    kv_cache [num_pages, Hkv, 2, page, D] (keys, values); query_start_loc [S+1];
    seq_lens [S]; block_table [S, max_pages]. Returns [T, H, D]."""
    T, H, D = q.shape
    hkv, page = kv_cache.shape[1], kv_cache.shape[3]
    assert page % BLOCK == 0, f"KV page size {page} must be a multiple of the attention block {BLOCK}"
    S = seq_lens.shape[0]
    seq_lens = seq_lens.long().contiguous()
    qsl = query_start_loc.long()
    qlens = qsl[1:] - qsl[:-1]
    Q = int(qlens.max()) if S else 0
    n_pages = -(-int(seq_lens.max()) // page) if S else 0
    ar = torch.arange(Q, device=q.device)
    idx = (qsl[:-1, None] + ar[None, :]).clamp(max=T - 1)
    qvalid = ar[None, :] < qlens[:, None]
    q_pos = torch.where(qvalid, seq_lens[:, None] - qlens[:, None] + ar[None, :], -1)
    # [2, S, Hkv, n_pages*page, D]: keys / values at absolute positions, in order.
    kv = kv_cache[block_table[:, :n_pages].long()].permute(3, 0, 2, 1, 4, 5)
    kv = kv.reshape(2, S, hkv, n_pages * page, D)
    rows, pos = _to_rows(q[idx], q_pos, hkv)
    out = _blocked_core(rows, kv[0], kv[1], pos.contiguous(), seq_lens, scale)
    out = _from_rows(out, S, Q, H, D, hkv, q.dtype)
    result = q.new_empty(T, H, D)
    result[idx[qvalid]] = out[qvalid]
    return result
