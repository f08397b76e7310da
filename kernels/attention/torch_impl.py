"""Fixed-block attention: the same arithmetic for trainer prefill, engine prefill
(chunked or not, with or without prefix-cache hits) and engine decode.

The algorithm (docs/kernels.md), all in fp32 whatever the model dtype:
  * Keys/values are cut into blocks of BLOCK positions at ABSOLUTE offsets (block j
    holds positions [j*BLOCK, (j+1)*BLOCK)).
  * Scores per block: one batched GEMM [R, D] x [D, BLOCK] per (sequence, kv head,
    block); masked positions (future, or cache slots past the sequence) get -inf. Cache
    slots past a sequence may hold uninitialised memory (NaN): the paged caller zeroes
    those values, so p = 0 times a finite value is exactly 0.
  * m = the row max over all visible scores: max is exact in any order, so it does not
    matter how many masked blocks a caller visits.
  * p = exp(s - m); per block l_j = sum of p over its BLOCK positions and
    pv_j = p_j @ V_j (contraction over exactly BLOCK); then l and acc are summed over
    blocks strictly in order j = 0, 1, ... A block in a row's future contributes
    exactly 0, so a decode step (few blocks) gives the bits of the prefill row (all
    blocks) and of the trainer's padded batch.
  * The GEMMs contract over D and BLOCK (small, fixed); MKL computes their rows
    invariantly when a call has a multiple of ROW_MULTIPLE rows (guard test); with
    exactly 2 rows (a GQA-2 decode) it took another path and rows differed in the last
    bit, so rows are zero-padded to a multiple of ROW_MULTIPLE.
"""

import torch

BLOCK = 32
ROW_MULTIPLE = 8


def _blocked_core(q, kt_blocks, v_blocks, q_pos, kv_len, scale):
    """q [S, Hkv, R, D]; kt_blocks [S, Hkv, NB, D, BLOCK] (keys TRANSPOSED, contiguous);
    v_blocks [S, Hkv, NB, BLOCK, D]; q_pos [S, R] (-1 = pad row); kv_len [S]. All fp32.
    Returns [S, Hkv, R, D].

    k^T must be contiguous: passed as a transposed view, MKL changed a row's bits with
    the row count at D = 256 (and at R = 2..5 for D = 128); contiguous it did not."""
    NB = kt_blocks.shape[2]
    kpos = torch.arange(NB * BLOCK, device=q.device).view(NB, BLOCK)
    in_cache = kpos[None] < kv_len[:, None, None]  # [S, NB, BLOCK]
    valid = (kpos[None, :, None, :] <= q_pos[:, None, :, None]) & in_cache[:, :, None, :]  # [S, NB, R, BLOCK]
    s = torch.matmul(q[:, :, None], kt_blocks) * scale  # [S, Hkv, NB, R, BLOCK]
    s = torch.where(valid[:, None], s, float("-inf"))
    m = s.amax(-1).amax(2)  # [S, Hkv, R]
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with nothing visible (padding)
    p = torch.exp(s - m[:, :, None, :, None])
    pv = torch.matmul(p, v_blocks)  # [S, Hkv, NB, R, D]; v_blocks must be finite (callers zero garbage)
    lj = p.sum(-1)  # [S, Hkv, NB, R]
    l, acc = lj[:, :, 0], pv[:, :, 0]
    for j in range(1, NB):  # fixed order: block 0, 1, 2, ...
        l = l + lj[:, :, j]
        acc = acc + pv[:, :, j]
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


def _dense_forward(q, k, v, scale):
    B, L, H, D = q.shape
    hkv = k.shape[2]
    nb = -(-L // BLOCK)
    pad = nb * BLOCK - L

    def blocks(t, transpose):  # [B, L, Hkv, D] -> fp32 [B, Hkv, NB, BLOCK, D] (or [.., D, BLOCK])
        if pad:
            t = torch.cat([t, t.new_zeros(B, pad, hkv, D)], 1)
        t = t.view(B, nb, BLOCK, hkv, D).permute(0, 3, 1, 4, 2) if transpose else \
            t.view(B, nb, BLOCK, hkv, D).permute(0, 3, 1, 2, 4)
        return torch.empty(t.shape, dtype=torch.float32, device=t.device).copy_(t)

    q_pos = torch.arange(L, device=q.device).expand(B, L)
    rows, pos = _to_rows(q, q_pos, hkv)
    kv_len = torch.full((B,), L, device=q.device, dtype=torch.long)
    out = _blocked_core(rows, blocks(k, True), blocks(v, False), pos, kv_len, scale)
    return _from_rows(out, B, L, H, D, hkv, q.dtype)


class _DenseAttention(torch.autograd.Function):
    """Exact forward; backward = the gradient of the same function computed by torch's
    SDPA (recomputed). Only the forward must be batch-invariant: it is what both
    engines compare. The gradient is the same function's, up to rounding."""

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
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _DenseAttention.apply(q, k, v, scale)
    return _dense_forward(q, k, v, scale)


def attention_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Engine path over a paged KV cache, prefills and decodes mixed in one flat stream.

    q [T, H, D] (flat); kv_cache [num_pages, Hkv, 2, page, D] (keys then values of a
    page and head side by side: vLLM's CPU layout); query_start_loc [S+1]; seq_lens [S]
    (KV length including this step's tokens); block_table [S, max_pages]. The queries
    of sequence s are its last (qlen) positions. Returns [T, H, D].

    Decodes (one query) and prefill chunks are computed in two groups: the core pads
    every sequence of a call to the longest query and the longest KV, so a decode batched
    with a 200-token prefill would pay for 200 rows. A row's bits do not depend on how
    many rows, blocks or sequences share a call (the invariance the core already relies
    on, pinned by the parity tests), so grouping changes no bits."""
    T, H, D = q.shape
    page = kv_cache.shape[3]
    assert page % BLOCK == 0, f"KV page size {page} must be a multiple of the attention block {BLOCK}"
    result = q.new_empty(T, H, D)
    S = seq_lens.shape[0]
    if S == 0:
        return result
    qsl = query_start_loc.long()
    starts, qlens = qsl[:-1], qsl[1:] - qsl[:-1]
    decode = qlens == 1
    groups = [decode, ~decode] if bool(decode.any()) and not bool(decode.all()) else [None]
    for sel in groups:
        if sel is None:
            _paged_group(q, kv_cache, starts, qlens, seq_lens.long(), block_table, scale, result)
        else:
            _paged_group(q, kv_cache, starts[sel], qlens[sel], seq_lens.long()[sel], block_table[sel], scale, result)
    return result


def _paged_group(q, kv_cache, starts, qlens, seq_lens, block_table, scale, result) -> None:
    """attention_paged for the sequences given (their query starts and lengths in the flat
    stream), written into `result`'s rows of those queries."""
    T, H, D = q.shape
    hkv, page = kv_cache.shape[1], kv_cache.shape[3]
    S = seq_lens.shape[0]
    Q = int(qlens.max())
    max_kv = int(seq_lens.max())
    n_pages = -(-max_kv // page)
    nb = -(-max_kv // BLOCK)  # blocks actually needed (pages may hold more)
    # Gather queries into [S, Q, H, D] (pad rows get position -1).
    ar = torch.arange(Q, device=q.device)
    idx = (starts[:, None] + ar[None, :]).clamp(max=T - 1)
    qvalid = ar[None, :] < qlens[:, None]
    q_pos = torch.where(qvalid, seq_lens[:, None] - qlens[:, None] + ar[None, :], -1)
    # Gather pages (one contiguous index for keys and values), then one fp32 copy into
    # the [2, S, Hkv, NB, BLOCK, D] layout the core reads.
    kv = kv_cache[block_table[:, :n_pages].long()]  # [S, n_pages, Hkv, 2, page, D]
    kv = kv.view(S, n_pages, hkv, 2, page // BLOCK, BLOCK, D)
    nbp = n_pages * page // BLOCK
    kt = kv[:, :, :, 0].permute(0, 2, 1, 3, 5, 4)  # [S, Hkv, n_pages, page/BLOCK, D, BLOCK]
    kb = torch.empty(kt.shape, dtype=torch.float32, device=q.device).copy_(kt).view(S, hkv, nbp, D, BLOCK)[:, :, :nb]
    vv = kv[:, :, :, 1].permute(0, 2, 1, 3, 4, 5)  # [S, Hkv, n_pages, page/BLOCK, BLOCK, D]
    vb = torch.empty(vv.shape, dtype=torch.float32, device=q.device).copy_(vv).view(S, hkv, nbp, BLOCK, D)[:, :, :nb]
    beyond = torch.arange(nb * BLOCK, device=q.device)[None, :] >= seq_lens[:, None]  # [S, nb*BLOCK]
    vb.masked_fill_(beyond.view(S, 1, nb, BLOCK, 1), 0.0)  # uninitialised slots -> exact zeros

    rows, pos = _to_rows(q[idx], q_pos, hkv)
    out = _blocked_core(rows, kb, vb, pos, seq_lens, scale)
    out = _from_rows(out, S, Q, H, D, hkv, q.dtype)  # [S, Q, H, D]
    result[idx[qvalid]] = out[qvalid]
