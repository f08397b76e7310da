"""GLM-5's kernels (docs/glm5.md): the indexer's top-k (kernels/indexer), attention over the
selected keys (kernels/sparse_attention), the indexer key's LayerNorm (kernels/layernorm) and the
sigmoid router (kernels/moe). Each against its plain fp64 reference at a stated tolerance, the
tie rule on constructed ties, and invariance with torch.equal: a row's bits are the same in the
trainer's dense view and the engine's paged one, alone, in any batch, in prefill chunks or
decode steps, at 1 and 2 threads. Fresh random inputs, odd sizes (row width 83, 3 heads of 24,
sequences of 1..150 tokens)."""

from __future__ import annotations

import pytest
import torch

from _paged_rows import dense_and_paged
from _threads import threads as thread_count
from titan_rl.kernels import index_topk, layer_norm, sparse_mla_attention
from titan_rl.kernels.indexer.reference import index_scores_reference, topk_reference
from titan_rl.kernels.layernorm.reference import layer_norm_reference
from titan_rl.kernels.moe import router_sigmoid_topk, topk_ties_low
from titan_rl.kernels.moe.reference import router_sigmoid_reference
from titan_rl.kernels.sparse_attention.reference import sparse_attention_reference
from titan_rl.kernels.sparse_attention.torch_impl import sparse_attention_eager

H, D, W, KEY_OFF, DQ, DV, TOPK = 3, 24, 83, 56, 56, 40, 16  # indexer heads x dim; row width; latent key / value
LENS = [37, 3, 150, 64, 1, 90]
DTYPES = [torch.float32, torch.bfloat16]
# Measured max |kernel - fp64 reference| (fp32 inputs of std 1, |out| <= ~2): sparse attention
# 4.8e-7; LayerNorm 9.5e-7 (|out| ~ 3). bf16 outputs are one rounding of the fp32 result: 2^-8
# relative. Index scores are compared through the selection: every selected position's fp64 score
# is >= every unselected one's, up to SCORE_TOL (fp32 sums over 24 products of std-1 values and 3
# heads: |score| <= ~30, an fp32 ulp there is 2e-6).
ATTN_ATOL = {torch.float32: 2e-6, torch.bfloat16: 2**-7}
LN_ATOL = {torch.float32: 4e-6, torch.bfloat16: 2**-6}
SCORE_TOL = 1e-4


class Seqs:
    """Random sequences of cache rows and per-position indexer queries / weights, with the two
    layouts the engines use: the trainer's dense [B, L, W] (one page per sequence) and a paged
    cache in shuffled pages of `page` rows (vLLM's)."""

    def __init__(self, rng, dtype, lens=LENS, page=16):
        self.lens, self.dtype, self.page = lens, dtype, page
        self.rows = [torch.randn(n, W, generator=rng).to(dtype) for n in lens]
        self.q = [torch.randn(n, H, D, generator=rng).to(dtype) for n in lens]
        self.w = [torch.randn(n, H, generator=rng) for n in lens]
        self.qa = [torch.randn(n, 4, DQ, generator=rng).to(dtype) for n in lens]  # 4 attention heads
        self.dense, self.paged = dense_and_paged(self.rows, page, rng, dtype, spare=3)

    def call(self, fn, items, layout, **kw):
        """fn over the query rows `items` ([(sequence, position)], one call), in a layout."""
        cache, bt = self.dense if layout == "dense" else self.paged
        seq = torch.tensor([s for s, _ in items])
        pos = torch.tensor([p for _, p in items])
        return fn(items, cache, bt, seq, pos, **kw)


def _topk(seqs: Seqs, items, cache, bt, seq, pos):
    q = torch.stack([seqs.q[s][p] for s, p in items])
    w = torch.stack([seqs.w[s][p] for s, p in items])
    return index_topk(q, w, cache, bt, seq, pos, KEY_OFF, D ** -0.5, TOPK)


def _attend(seqs: Seqs, items, cache, bt, seq, pos, sets):
    q = torch.stack([seqs.qa[s][p] for s, p in items])
    ind = torch.stack([sets[(s, p)] for s, p in items])
    return sparse_mla_attention(q, cache, bt, seq, ind, DQ ** -0.5, DV)


def _compositions(seqs: Seqs, rng):
    """Ways the same rows reach a kernel: all in one call per layout; every sequence alone;
    decode-sized calls (one row per sequence per call); prefill in random chunks mixed with
    other sequences' rows; a shuffled sequence order."""
    every = [(s, p) for s, n in enumerate(seqs.lens) for p in range(n)]
    yield "dense, one call", "dense", [every]
    yield "paged, one call", "paged", [every]
    yield "paged, each sequence alone", "paged", [[(s, p) for p in range(n)] for s, n in enumerate(seqs.lens)]
    yield "paged, one position of each sequence per call", "paged", [
        [(s, p) for s, n in enumerate(seqs.lens) if p < n] for p in range(max(seqs.lens))]
    chunks = []
    for s, n in enumerate(seqs.lens):
        cuts = sorted(set(torch.randint(1, max(n, 2), (3,), generator=rng).tolist()) | {0, n})
        chunks += [[(s, p) for p in range(a, b)] for a, b in zip(cuts, cuts[1:]) if b > a]
    perm = torch.randperm(len(chunks), generator=rng).tolist()
    yield "paged, random prefill chunks", "paged", [chunks[i] + chunks[j] for i, j in zip(perm[::2], perm[1::2])] + (
        [chunks[perm[-1]]] if len(perm) % 2 else [])
    order = torch.randperm(len(seqs.lens), generator=rng).tolist()
    yield "dense, shuffled order", "dense", [[(s, p) for s in order for p in range(seqs.lens[s])]]


def _per_row(seqs, fn, calls, layout, **kw):
    out = {}
    for items in calls:
        res = seqs.call(fn, items, layout, **kw)
        for it, r in zip(items, res):
            out[it] = r
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_topk_selects_a_top_k_of_the_reference_scores(rng, dtype):
    seqs = Seqs(rng, dtype)
    every = [(s, p) for s, n in enumerate(seqs.lens) for p in range(n)]
    got = seqs.call(lambda *a: _topk(seqs, *a), every, "paged")
    cache, bt = seqs.paged
    seq, pos = torch.tensor([s for s, _ in every]), torch.tensor([p for _, p in every])
    q = torch.stack([seqs.q[s][p] for s, p in every])
    w = torch.stack([seqs.w[s][p] for s, p in every])
    ref = index_scores_reference(q, w, cache, bt, seq, pos, KEY_OFF, D ** -0.5)
    for (s, p), sel, r in zip(every, got, ref):
        n = min(TOPK, p + 1)
        chosen = sel[sel >= 0]
        assert chosen.numel() == n and torch.equal(chosen, chosen.sort().values) and (sel[n:] == -1).all()
        out = torch.ones(p + 1, dtype=torch.bool)
        out[chosen] = False
        if out.any():
            assert float(r[chosen].min()) >= float(r[out].max()) - SCORE_TOL, (s, p)
    assert sum(int((sel >= 0).sum()) < len(range(p + 1)) for (s, p), sel in zip(every, got)) > 100  # it selects


def test_index_topk_tie_rule_lowest_position_wins():
    """relu zeroes every key whose dot products are all negative: exact ties at 0 (common with
    few indexer heads). Among equal scores the lowest positions win, as the reference's order."""
    n, k = 40, 12
    keys = torch.zeros(n, W)
    pos_score = torch.tensor([5, 9, 17, 30, 33])  # 5 positions with distinct positive scores
    keys[:, KEY_OFF] = -1.0
    keys[pos_score, KEY_OFF] = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0])
    q = torch.zeros(1, H, D)
    q[0, :, 0] = 1.0
    w = torch.ones(1, H)
    cache, bt = keys.view(1, n, W), torch.zeros(1, 1, dtype=torch.long)
    sel = index_topk(q, w, cache, bt, torch.tensor([0]), torch.tensor([n - 1]), KEY_OFF, 1.0, k)[0]
    zeros = [j for j in range(n) if j not in pos_score.tolist()][: k - 5]
    assert sel.tolist() == sorted(pos_score.tolist() + zeros)
    ref = topk_reference(index_scores_reference(q, w, cache, bt, torch.tensor([0]), torch.tensor([n - 1]), KEY_OFF,
                                                1.0)[0], k)
    assert torch.equal(sel, ref)
    # all scores equal: positions 0..k-1; -0.0 ties with +0.0 (negative weights times relu's 0)
    w_neg = -torch.ones(1, H)
    sel = index_topk(q, w_neg, torch.full((1, n, W), -1.0), bt, torch.tensor([0]), torch.tensor([n - 1]), KEY_OFF,
                     1.0, k)[0]
    assert sel.tolist() == list(range(k))


def test_index_topk_rows_are_invariant(rng, at_1_and_2_threads):
    for dtype in DTYPES:
        seqs = Seqs(rng, dtype, page=32 if dtype == torch.bfloat16 else 16)
        base = None
        for what, layout, calls in _compositions(seqs, rng):
            got = _per_row(seqs, lambda *a: _topk(seqs, *a), calls, layout)
            if base is None:
                base = got
                continue
            assert got.keys() == base.keys(), what
            bad = [it for it in base if not torch.equal(got[it], base[it])]
            assert not bad, f"{dtype} {what}: {len(bad)} rows differ, e.g. {bad[:3]}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_attention_matches_reference(rng, dtype):
    seqs = Seqs(rng, dtype)
    every = [(s, p) for s, n in enumerate(seqs.lens) for p in range(n)]
    sets = dict(zip(every, seqs.call(lambda *a: _topk(seqs, *a), every, "paged")))
    got = seqs.call(lambda *a: _attend(seqs, *a, sets=sets), every, "paged")
    cache, bt = seqs.paged
    q = torch.stack([seqs.qa[s][p] for s, p in every])
    ind = torch.stack([sets[it] for it in every])
    seq = torch.tensor([s for s, _ in every])
    ref = sparse_attention_reference(q, cache, bt, seq, ind, DQ ** -0.5, DV)
    assert got.dtype == dtype and got.shape == (len(every), 4, DV)
    scale = max(1.0, float(ref.float().abs().max())) if dtype == torch.bfloat16 else 1.0
    torch.testing.assert_close(got.float(), ref.float(), atol=ATTN_ATOL[dtype] * scale, rtol=0)
    eager = sparse_attention_eager(q, cache, bt, seq, ind, DQ ** -0.5, DV)  # the stock form / the backward's
    torch.testing.assert_close(eager.float(), ref.float(), atol=ATTN_ATOL[dtype] * scale, rtol=0)


def test_sparse_attention_rows_are_invariant(rng, at_1_and_2_threads):
    for dtype in DTYPES:
        seqs = Seqs(rng, dtype, page=32)
        every = [(s, p) for s, n in enumerate(seqs.lens) for p in range(n)]
        sets = dict(zip(every, seqs.call(lambda *a: _topk(seqs, *a), every, "dense")))
        base = None
        for what, layout, calls in _compositions(seqs, rng):
            got = _per_row(seqs, lambda *a: _attend(seqs, *a, sets=sets), calls, layout)
            if base is None:
                base = got
                continue
            bad = [it for it in base if not torch.equal(got[it], base[it])]
            assert not bad, f"{dtype} {what}: {len(bad)} rows differ, e.g. {bad[:3]}"


def _dense_masked_attention(q, cache, row_seq, indices, scale: float, dv: int) -> torch.Tensor:
    """An independent reference for the gradient: every row against ALL its sequence's
    positions of the dense [B, L, W] cache, the unselected ones masked to -inf (no gather of the
    selected rows, no ordering), plain autograd in q's dtype."""
    keys = cache[row_seq]  # [T, L, W]
    s = torch.einsum("thd,tld->thl", q, keys[..., : q.shape[-1]]) * scale
    chosen = torch.zeros(q.shape[0], cache.shape[1] + 1, dtype=torch.bool)
    chosen[torch.arange(q.shape[0])[:, None], indices.where(indices >= 0, cache.shape[1])] = True  # -1: a spare column
    p = torch.softmax(s.masked_fill(~chosen[:, None, :-1], float("-inf")), -1)
    return torch.einsum("thl,tld->thd", p, keys[..., :dv])


def _attention_grads(fn, q, cache, bt, seq, ind, upstream):
    q_, c_ = q.detach().clone().requires_grad_(), cache.detach().clone().requires_grad_()
    (fn(q_, c_, bt, seq, ind, DQ ** -0.5, DV) * upstream).sum().backward()
    return q_.grad, c_.grad


def test_sparse_attention_gradient_matches_a_dense_masked_reference(rng):
    """The trainer's backward of sparse_mla_attention against a dense masked attention in fp64
    autograd (`_dense_masked_attention`), q and cache gradients: within 8 fp32 epsilons of the
    largest reference gradient entry (measured 1.3: fp32 softmax and sums over <= 16 keys, 4
    heads and 56 / 40 channels, a few roundings per entry; a wrong mask, scale or missing term
    is off by O(1)). With torch.equal what the code claims: the backward IS the eager function's
    gradient (torch_impl recomputes it), and its bits are the same on every rerun and at 1 and 2
    threads (before `selected_rows` gathered by index_select, advanced indexing's atomic adds gave a cached position read
    by several rows different bits from run to run at 2 threads, for about half the seeds). The
    backward claims no batch invariance (a cached position's gradient sums the rows that read
    it, so which rows share the call changes it); the trainer needs the same bits for the same
    batch only."""
    seqs = Seqs(rng, torch.float32, lens=[9, 20, 37])
    every = [(s, p) for s, n in enumerate(seqs.lens) for p in range(n)]
    sets = dict(zip(every, seqs.call(lambda *a: _topk(seqs, *a), every, "dense")))
    cache, bt = seqs.dense
    q = torch.stack([seqs.qa[s][p] for s, p in every])
    ind = torch.stack([sets[it] for it in every])
    seq = torch.tensor([s for s, _ in every])
    upstream = torch.randn(len(every), 4, DV, generator=rng)
    got = _attention_grads(sparse_mla_attention, q, cache, bt, seq, ind, upstream)
    ref = _attention_grads(lambda q_, c_, *a: _dense_masked_attention(q_, c_, seq, ind, *a[3:]), q.double(),
                           cache.double(), bt, seq, ind, upstream.double())
    for g, r, what in zip(got, ref, ("q", "cache")):
        assert g.dtype == torch.float32
        err, top = float((g.double() - r).abs().max()), float(r.abs().max())
        assert err <= 8 * torch.finfo(torch.float32).eps * top, (what, err, top)
    again = [_attention_grads(sparse_attention_eager, q, cache, bt, seq, ind, upstream)]
    for n in (1, 2, 2, 2):
        with thread_count(n):
            again.append(_attention_grads(sparse_mla_attention, q, cache, bt, seq, ind, upstream))
    for g in again:
        assert torch.equal(g[0], got[0]) and torch.equal(g[1], got[1])
    assert got[1][:, :, DQ:].abs().max() == 0  # the indexer keys past the latent get no gradient


@pytest.mark.parametrize("width", [24, 200])
def test_layer_norm_matches_reference_and_rows_are_invariant(rng, width, at_1_and_2_threads):
    for dtype in DTYPES:
        x = (torch.randn(70, width, generator=rng) * 2 + 0.5).to(dtype)
        w, b = torch.randn(width, generator=rng).to(dtype), torch.randn(width, generator=rng).to(dtype)
        got = layer_norm(x, w, b, 1e-6)
        ref = layer_norm_reference(x, w, b, 1e-6)
        scale = max(1.0, float(ref.float().abs().max())) if dtype == torch.bfloat16 else max(1.0, float(ref.abs().max()))
        torch.testing.assert_close(got.float(), ref.float(), atol=LN_ATOL[dtype] * scale, rtol=0)
        for m in (1, 2, 5, 17, 64):
            assert torch.equal(layer_norm(x[:m], w, b, 1e-6), got[:m])
        assert torch.equal(layer_norm(x[33:34], w, b, 1e-6), got[33:34])


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_sigmoid_router_matches_reference(rng, n_group, topk_group):
    E, k, hidden = 8, 3, 75
    x = torch.randn(60, hidden, generator=rng)
    gw = torch.randn(E, hidden, generator=rng) * 0.3
    bias = torch.randn(E, generator=rng) * 0.1
    w, ids, own = router_sigmoid_topk(x, gw, bias, k, n_group, topk_group, True, 2.5, sigmoid=torch.sigmoid)
    rw, rids = router_sigmoid_reference(x, gw, bias, k, n_group, topk_group, True, 2.5)
    assert torch.equal(ids, rids) and torch.equal(own, ids)
    torch.testing.assert_close(w.double(), rw, atol=1e-5, rtol=0)
    # replay: the forced experts' current scores, renormalised; rows starting with -1 keep their own
    forced = torch.stack([ids[:, [1, 0, 2]][:30], torch.full((30, k), -1)]).view(60, k)
    w2, ids2, _ = router_sigmoid_topk(x, gw, bias, k, n_group, topk_group, True, 2.5, sigmoid=torch.sigmoid,
                                      route_override=forced)
    assert torch.equal(ids2[:30], ids[:30, [1, 0, 2]]) and torch.equal(ids2[30:], ids[30:])


def test_expert_ties_go_to_the_lowest_index():
    scores = torch.tensor([[0.5, 0.7, 0.7, 0.1, 0.7], [0.2, 0.2, 0.2, 0.2, 0.2]])
    assert topk_ties_low(scores, 3).tolist() == [[1, 2, 4], [0, 1, 2]]
    with pytest.raises(ValueError, match="NaN"):
        topk_ties_low(torch.tensor([[float("nan"), 1.0]]), 1)


def test_reads_outside_the_cache_are_refused(rng):
    """A wrong set (a replayed one, say) must fail loudly, not read past the block table."""
    seqs = Seqs(rng, torch.float32, lens=[20, 5], page=16)
    cache, bt = seqs.paged
    q = torch.randn(1, 4, DQ, generator=rng)
    ind = torch.full((1, TOPK), -1)
    ind[0, :2] = torch.tensor([3, 40])  # sequence 1 has one page: position 40 is past it
    with pytest.raises(RuntimeError, match="reads position 40 past its block table"):
        sparse_mla_attention(q, cache, bt, torch.tensor([1]), ind, 1.0, DV)
    with pytest.raises(RuntimeError, match="names sequence 5"):
        sparse_mla_attention(q, cache, bt, torch.tensor([5]), ind, 1.0, DV)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_head_tree_backward_gives_each_split_of_the_heads_the_same_bits(rng, dtype):
    """Ops.sparse_attention_heads (the trainer with TP pieces): MLA's heads share the latent
    rows, so the cache's gradient sums over heads. Computed per head and added by one fixed tree
    over all heads, it is the same whether one call holds the 5 heads or two calls ("TP ranks")
    hold 2 and 3 and join their parts through `gather`: q's and the cache's gradients and the
    indexer loss's target (attention_target) torch.equal. The forward is the kernel's, bit for
    bit; the gradients are within 8 fp32 epsilons of the dense masked fp64 reference above."""
    from titan_rl.kernels.sparse_attention.torch_impl import attention_target, sparse_attention_heads
    from titan_rl.kernels import tree_sum

    n_heads = 5
    seqs = Seqs(rng, dtype, lens=[9, 20, 37])
    every = [(s, p) for s, n in enumerate(seqs.lens) for p in range(n)]
    sets = dict(zip(every, seqs.call(lambda *a: _topk(seqs, *a), every, "dense")))
    cache, bt = seqs.dense
    q = torch.randn(len(every), n_heads, DQ, generator=rng).to(dtype)
    ind = torch.stack([sets[it] for it in every])
    seq = torch.tensor([s for s, _ in every])
    upstream = torch.randn(len(every), n_heads, DV, generator=rng).to(dtype)
    scale = DQ ** -0.5

    def grads(heads: slice, gather=None):
        q_ = q[:, heads].detach().clone().requires_grad_()
        c_ = cache.detach().clone().requires_grad_()
        out = sparse_attention_heads(q_, c_, bt, seq, ind, scale, DV, sparse_mla_attention, tree_sum, gather)
        (out.float() * upstream[:, heads].float()).sum().backward()
        return out, q_.grad, c_.grad

    out, gq, gc = grads(slice(None))
    assert torch.equal(out, sparse_mla_attention(q, cache, bt, seq, ind, scale, DV))
    halves = (slice(0, 2), slice(2, n_heads))
    parts = {}

    def record(key):  # a "rank" run once to learn its heads' parts (the result is not used)
        def gather(p):
            parts[key] = p.clone()
            return torch.cat([p, p.new_zeros(n_heads - p.shape[0], *p.shape[1:])])
        return gather

    for h in halves:
        grads(h, gather=record(h.start))
    joined = torch.cat([parts[0], parts[2]])
    split = [grads(h, gather=lambda p: joined) for h in halves]
    assert torch.equal(torch.cat([s[1] for s in split], 1), gq)
    assert all(torch.equal(s[2], gc) for s in split)

    target = attention_target(q, cache, bt, seq, ind, scale)
    alone = attention_target(q[:, halves[0]], cache, bt, seq, ind, scale)
    assert not torch.equal(alone, target)  # two heads alone are another distribution
    probs = {}
    for h in halves:
        attention_target(q[:, h], cache, bt, seq, ind, scale, gather=lambda p, h=h: probs.setdefault(h.start, p))
    both = torch.cat([probs[0], probs[2]])
    assert all(torch.equal(attention_target(q[:, h], cache, bt, seq, ind, scale, gather=lambda p: both), target)
               for h in halves)

    if dtype == torch.float32:
        ref = _attention_grads(lambda q_, c_, *a: _dense_masked_attention(q_, c_, seq, ind, *a[3:]), q.double(),
                               cache.double(), bt, seq, ind, upstream.double())
        for g, r, what in zip((gq, gc), ref, ("q", "cache")):
            err, top = float((g.double() - r).abs().max()), float(r.abs().max())
            assert err <= 8 * torch.finfo(torch.float32).eps * top, (what, err, top)
