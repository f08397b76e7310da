"""Fixed-block attention: the same arithmetic for trainer prefill, engine prefill
(chunked or not, with or without prefix-cache hits) and engine decode.

The algorithm (docs/kernels.md):
  * Keys/values are visited in blocks of BLOCK positions at ABSOLUTE offsets
    (block j holds positions [j*BLOCK, (j+1)*BLOCK)), always in order j = 0, 1, ...
  * Online softmax in fp32 (running max m, normaliser l, accumulator acc).
  * A block that is entirely in a row's future is a bitwise no-op for that row
    (p = 0, alpha = exp(0) = 1), so visiting more blocks (a longer padded batch,
    a whole-sequence prefill) gives the same bits as visiting fewer (decode).
  * Positions that are masked or hold uninitialised cache memory get score -inf and
    value 0, so their contribution is exactly 0.
  * The two GEMMs per block contract over D (scores) and BLOCK (values): small
    fixed K, which MKL computes row-invariantly once a call has >= 2 rows
    (guard test) when its row count is a multiple of ROW_MULTIPLE; with exactly 2
    rows (a GQA-2 decode) MKL took another path and rows differed in the last bit,
    so rows are zero-padded to a multiple of ROW_MULTIPLE.
Everything runs in fp32 whatever the model dtype; the output is cast back.
"""

import torch

BLOCK = 32
ROW_MULTIPLE = 8


def _blocked_core(q, k_blocks, v_blocks, q_pos, kv_len, scale):
    """q [S, Hkv, R, D]; k/v_blocks [S, Hkv, NB, BLOCK, D]; q_pos [S, R] (-1 = pad row);
    kv_len [S]. All fp32. Returns [S, Hkv, R, D]."""
    S, Hkv, R, D = q.shape
    NB = k_blocks.shape[2]
    m = q.new_full((S, Hkv, R), float("-inf"))
    l = q.new_zeros((S, Hkv, R))
    acc = q.new_zeros((S, Hkv, R, D))
    offs = torch.arange(BLOCK, device=q.device)
    for j in range(NB):
        kpos = j * BLOCK + offs  # [BLOCK]
        in_cache = kpos[None, :] < kv_len[:, None]  # [S, BLOCK]
        valid = (kpos[None, None, :] <= q_pos[:, :, None]) & in_cache[:, None, :]  # [S, R, BLOCK]
        s = torch.matmul(q, k_blocks[:, :, j].transpose(-1, -2)) * scale  # [S, Hkv, R, BLOCK]
        s = torch.where(valid[:, None], s, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        vj = torch.where(in_cache[:, None, :, None], v_blocks[:, :, j], 0.0)
        acc = acc * alpha[..., None] + torch.matmul(p, vj)
        m = m_new
    return acc / torch.where(l == 0, torch.ones_like(l), l)[..., None]


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


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Trainer path. q [B, L, H, D], k/v [B, L, Hkv, D], sequences start at position 0,
    causal. Right padding is harmless (a row never sees later positions)."""
    B, L, H, D = q.shape
    hkv = k.shape[2]
    nb = -(-L // BLOCK)
    pad = nb * BLOCK - L

    def blocks(t):
        t = t.float()
        if pad:
            t = torch.cat([t, t.new_zeros(B, pad, hkv, D)], 1)
        return t.view(B, nb, BLOCK, hkv, D).permute(0, 3, 1, 2, 4)

    q_pos = torch.arange(L, device=q.device).expand(B, L)
    rows, pos = _to_rows(q, q_pos, hkv)
    kv_len = torch.full((B,), L, device=q.device, dtype=torch.long)
    out = _blocked_core(rows, blocks(k), blocks(v), pos, kv_len, scale)
    return _from_rows(out, B, L, H, D, hkv, q.dtype)


def attention_paged(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Engine path over a paged KV cache, prefills and decodes mixed in one flat stream.

    q [T, H, D] (flat); key/value_cache [num_pages, Hkv, page, D]; query_start_loc
    [S+1]; seq_lens [S] (KV length including this step's tokens); block_table
    [S, max_pages]. The queries of sequence s are its last (qlen) positions.
    Returns [T, H, D]."""
    T, H, D = q.shape
    hkv, page = key_cache.shape[1], key_cache.shape[2]
    assert page % BLOCK == 0, f"KV page size {page} must be a multiple of the attention block {BLOCK}"
    S = seq_lens.shape[0]
    qsl = query_start_loc.long()
    qlens = qsl[1:] - qsl[:-1]
    Q = int(qlens.max()) if S else 0
    max_kv = int(seq_lens.max()) if S else 0
    n_pages = -(-max_kv // page)
    # Gather queries into [S, Q, H, D] (pad rows get position -1).
    ar = torch.arange(Q, device=q.device)
    idx = (qsl[:-1, None] + ar[None, :]).clamp(max=T - 1)
    qvalid = ar[None, :] < qlens[:, None]
    qb = q[idx]
    q_pos = torch.where(qvalid, seq_lens[:, None].long() - qlens[:, None] + ar[None, :], -1)
    # Gather pages -> [S, Hkv, NB, BLOCK, D].
    pages = block_table[:, :n_pages].long()

    def blocks(cache):
        t = cache[pages].float()  # [S, n_pages, Hkv, page, D]
        t = t.permute(0, 2, 1, 3, 4).reshape(S, hkv, n_pages * page, D)
        return t.view(S, hkv, n_pages * page // BLOCK, BLOCK, D)

    rows, pos = _to_rows(qb, q_pos, hkv)
    out = _blocked_core(rows, blocks(key_cache), blocks(value_cache), pos, seq_lens.long(), scale)
    out = _from_rows(out, S, Q, H, D, hkv, q.dtype)  # [S, Q, H, D]
    result = q.new_empty(T, H, D)
    result[idx[qvalid]] = out[qvalid]
    return result
