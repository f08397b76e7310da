"""GLM-5's Triton forms (kernels/{layernorm,indexer,sparse_attention}/triton_impl.py and the
sigmoid router of kernels/moe/triton_impl.py) under TRITON_INTERPRET=1 on CPU tensors: each
against its fp64 reference at the CPU form's tolerances (tests/test_glm5_kernels.py), the tie
rules on constructed ties, and row invariance with torch.equal (alone, in other batches, in the
trainer's dense layout and the engine's paged one); a tiny GLM-5 model on the Triton column.
Odd sizes: 7 indexer heads of 24, latent keys of 40 and values of 24, top-k 5, hidden 70, 12
experts in groups of 3; tiny, as the interpreter is slow.

TRITON_INTERPRET must be set before triton is first imported: as tests/test_triton_kernels.py,
this module runs in-process when the variable was set from the start
(`TRITON_INTERPRET=1 pytest tests/test_triton_glm5.py`), and otherwise
test_in_a_fresh_interpreter_process runs this file in a child process.
"""

import importlib
import os

_PREV = os.environ.get("TRITON_INTERPRET")
# in-process only when the interpreter was on from the start: a module that other test files
# import after this one (a triton_impl) would otherwise be decorated for a GPU (measured:
# with test_dispatch.py or test_triton_glm5.py in the same process, 1-5 tests failed)
IN_PROCESS = _PREV == "1"
if IN_PROCESS:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors, no GPU

import pytest  # noqa: E402

from _interpreter_harness import harness, restore  # noqa: E402

pytest.importorskip("numpy")
pytest.importorskip("triton")

import torch  # noqa: E402

from _paged_rows import dense_and_paged  # noqa: E402

import titan_rl.kernels as K  # noqa: E402
from titan_rl.kernels import dispatch  # noqa: E402
from titan_rl.kernels.gdn import lane_stable  # noqa: E402
from titan_rl.kernels.indexer import torch_impl as ix_cpu  # noqa: E402
from titan_rl.kernels.indexer import triton_impl as ix  # noqa: E402
from titan_rl.kernels.indexer.reference import index_scores_reference, topk_reference  # noqa: E402
from titan_rl.kernels.layernorm import triton_impl as ln  # noqa: E402
from titan_rl.kernels.layernorm.reference import layer_norm_reference  # noqa: E402
from titan_rl.kernels.layernorm.torch_impl import layer_norm_eager  # noqa: E402
from titan_rl.kernels.matmul import triton_impl as mm  # noqa: E402
from titan_rl.kernels.moe import torch_impl as moe_cpu  # noqa: E402
from titan_rl.kernels.moe import triton_impl as mo  # noqa: E402
from titan_rl.kernels.moe.reference import router_sigmoid_reference  # noqa: E402
from titan_rl.kernels.sparse_attention import triton_impl as sa  # noqa: E402
from titan_rl.kernels.sparse_attention.reference import sparse_attention_reference  # noqa: E402
from titan_rl.kernels.sparse_attention.torch_impl import sparse_attention_eager  # noqa: E402

if IN_PROCESS:
    # @triton.jit picks interpreter vs compiler when a kernel is decorated (at import): if
    # these modules were imported before the variable was set, re-decorate them. The model
    # test reaches the other Triton modules too: they are imported (and re-decorated) here,
    # while the variable is set, not later by another test module collected after this one.
    from titan_rl.kernels.attention import triton_impl as _attn
    from titan_rl.kernels.elementwise import triton_impl as _ew
    from titan_rl.kernels.lm_head import triton_impl as _lm
    from titan_rl.kernels.rmsnorm import triton_impl as _rn

    mm = importlib.reload(mm)
    for _m in (_attn, _ew, _rn, _lm):  # _lm after mm: it binds mm.linear
        importlib.reload(_m)
    mo = importlib.reload(mo)  # after mm: it binds mm.linear
    ln, ix, sa = (importlib.reload(m) for m in (ln, ix, sa))
    from titan_rl.kernels.interpreter import pin_interpreter_dot

    pin_interpreter_dot()  # tl.dot without the host BLAS's row-position dependence


restore(_PREV)  # set only while this module imports (above) and runs (_interpreter_env)
_interpreter_env, _in_process_only, test_in_a_fresh_interpreter_process = harness(_PREV, IN_PROCESS, __file__)


H, D, W, KEY_OFF, DQ, DV, TOPK = 7, 24, 83, 56, 40, 24, 5  # indexer heads x dim; row width; latent key / value
HA = 7  # attention heads
LENS = [37, 6, 13]
DTYPES = [torch.float32, torch.bfloat16]
# the CPU form's tolerances (tests/test_glm5_kernels.py): the same math, other summation orders
ATTN_ATOL = {torch.float32: 2e-6, torch.bfloat16: 2**-7}
LN_ATOL = {torch.float32: 4e-6, torch.bfloat16: 2**-6}
SCORE_TOL = 1e-4


class Seqs:
    """Random sequences of cache rows, indexer queries / weights and attention queries, in the
    trainer's dense layout [B, L, W] (one page per sequence) and a paged cache of shuffled
    pages (unused pages and slots hold NaN: a read outside a row's positions would show)."""

    def __init__(self, rng, dtype, lens=LENS, page=5):
        self.lens = lens
        self.rows = [torch.randn(n, W, generator=rng).to(dtype) for n in lens]
        self.q = [torch.randn(n, H, D, generator=rng).to(dtype) for n in lens]
        self.w = [torch.randn(n, H, generator=rng) for n in lens]
        self.qa = [torch.randn(n, HA, DQ, generator=rng).to(dtype) for n in lens]
        self.dense, self.paged = dense_and_paged(self.rows, page, rng, dtype, spare=2, dense_fill=float("nan"))
        self.every = [(s, p) for s, n in enumerate(lens) for p in range(n)]

    def args(self, items, layout):
        cache, bt = self.dense if layout == "dense" else self.paged
        return cache, bt, torch.tensor([s for s, _ in items]), torch.tensor([p for _, p in items])

    def topk(self, fn, items, layout):
        cache, bt, seq, pos = self.args(items, layout)
        q = torch.stack([self.q[s][p] for s, p in items])
        w = torch.stack([self.w[s][p] for s, p in items])
        return fn(q, w, cache, bt, seq, pos, KEY_OFF, D ** -0.5, TOPK)

    def attend(self, fn, items, layout, sets):
        cache, bt, seq, _ = self.args(items, layout)
        q = torch.stack([self.qa[s][p] for s, p in items])
        return fn(q, cache, bt, seq, torch.stack([sets[it] for it in items]), DQ ** -0.5, DV)

    def compositions(self):
        """The same rows reaching the kernel in other batches: all at once in either layout;
        each sequence alone; decode-sized calls (one position of each sequence per call)."""
        yield "paged, each sequence alone", "paged", [[(s, p) for p in range(n)] for s, n in enumerate(self.lens)]
        yield "dense, one call", "dense", [self.every]
        yield "paged, one position of each sequence per call", "paged", [
            [(s, p) for s, n in enumerate(self.lens) if p < n] for p in range(max(self.lens))]


def _per_row(calls, fn):
    out = {}
    for items in calls:
        for it, r in zip(items, fn(items)):
            out[it] = r
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_reference_and_is_row_invariant(dtype, rng):
    x = (torch.randn(9, 70, generator=rng) * 2 + 0.5).to(dtype)
    w, b = torch.randn(70, generator=rng).to(dtype), torch.randn(70, generator=rng).to(dtype)
    got = ln.layer_norm(x, w, b, 1e-6)
    ref = layer_norm_reference(x, w, b, 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=LN_ATOL[dtype] * max(1.0, float(ref.float().abs().max())),
                               rtol=0)
    for m in (1, 2, 5):
        assert torch.equal(ln.layer_norm(x[:m], w, b, 1e-6), got[:m]), m
        assert torch.equal(ln.layer_norm(x[-m:], w, b, 1e-6), got[-m:]), m
    assert torch.equal(ln.layer_norm(x[4:5], w, b, 1e-6), got[4:5])
    assert torch.equal(ln.layer_norm(x.view(3, 3, 70), w, b, 1e-6).view(9, 70), got)  # leading dims
    if dtype == torch.float32:  # the backward is the eager function's gradient
        xs = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
        xe = [t.detach().clone().requires_grad_() for t in xs]
        up = torch.randn(9, 70, generator=rng)
        (ln.layer_norm(*xs, 1e-6) * up).sum().backward()
        (layer_norm_eager(*xe, 1e-6) * up).sum().backward()
        for a, e in zip(xs, xe):
            assert torch.equal(a.grad, e.grad)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_sigmoid_router_matches_reference_and_is_row_invariant(rng, n_group, topk_group):
    """The sigmoid is the caller's (the model passes its row-stable elementwise form; on CPU
    tensors torch.sigmoid's bits depend on an element's position in its vector loop, so the
    test passes the lane-stable one, as the exact mode does)."""
    E, k, hidden = 12, 5, 70
    sigmoid = lambda z: lane_stable(torch.sigmoid, z)  # noqa: E731
    x = torch.randn(9, hidden, generator=rng)
    gw = torch.randn(E, hidden, generator=rng) * 0.3
    bias = torch.randn(E, generator=rng) * 0.1
    w, ids, own = mo.router_sigmoid_topk(x, gw, bias, k, n_group, topk_group, True, 2.5, sigmoid=sigmoid)
    rw, rids = router_sigmoid_reference(x, gw, bias, k, n_group, topk_group, True, 2.5)
    assert torch.equal(ids, rids) and torch.equal(own, ids)
    torch.testing.assert_close(w.double(), rw, atol=1e-5, rtol=0)  # the CPU form's tolerance
    # the same ids as the CPU form's rule on the same choice scores, and torch_impl's topk_fn maps
    # onto this module's kernel
    scores = sigmoid(mm.linear(x, gw))
    choice = moe_cpu.group_limited_choice(scores + bias, n_group, topk_group)
    assert torch.equal(moe_cpu.topk_ties_low(choice, k), ids)
    w2, ids2, _ = mo.router_sigmoid_topk(x, gw, bias, k, n_group, topk_group, True, 2.5, sigmoid=sigmoid,
                                         topk_fn=moe_cpu.topk_ties_low)
    assert torch.equal(ids2, ids) and torch.equal(w2, w)
    for m in (1, 2, 5):
        wm, im, _ = mo.router_sigmoid_topk(x[:m], gw, bias, k, n_group, topk_group, True, 2.5, sigmoid=sigmoid)
        assert torch.equal(wm, w[:m]) and torch.equal(im, ids[:m]), m
        wm, im, _ = mo.router_sigmoid_topk(x[-m:], gw, bias, k, n_group, topk_group, True, 2.5, sigmoid=sigmoid)
        assert torch.equal(wm, w[-m:]) and torch.equal(im, ids[-m:]), m
    # replay: the forced experts; rows starting with -1 keep their own
    forced = torch.cat([ids[:4, [1, 0, 2, 4, 3]], torch.full((5, k), -1)])
    _, ids3, _ = mo.router_sigmoid_topk(x, gw, bias, k, n_group, topk_group, True, 2.5, sigmoid=sigmoid,
                                        route_override=forced)
    assert torch.equal(ids3[:4], ids[:4, [1, 0, 2, 4, 3]]) and torch.equal(ids3[4:], ids[4:])


def test_expert_ties_go_to_the_lowest_index():
    inf = float("inf")
    scores = torch.tensor([[0.5, 0.7, 0.7, 0.1, 0.7], [0.2, 0.2, 0.2, 0.2, 0.2], [-inf, 0.3, -inf, -inf, -inf]])
    assert mo.topk_ties_low(scores, 3).tolist() == [[1, 2, 4], [0, 1, 2], [1, 0, 2]]
    assert torch.equal(mo.topk_ties_low(scores, 3), moe_cpu.topk_ties_low(scores, 3))
    with pytest.raises(ValueError, match="NaN"):
        mo.topk_ties_low(torch.tensor([[float("nan"), 1.0]]), 1)
    # groups: both groups tie on their top-2 sums (a tied maximum counts twice); the lower group wins
    c = torch.tensor([[0.5, 0.5, 0.125, 0.75, 0.25, 0.25]])  # exact sums: 1.0 and 1.0
    assert mo._sigmoid_choice(c, 2, 2, 1).tolist() == [[0, 1]]
    assert torch.equal(mo._sigmoid_choice(c, 2, 2, 1), moe_cpu.topk_ties_low(moe_cpu.group_limited_choice(c, 2, 1), 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_topk_selects_a_top_k_of_the_reference_scores_and_rows_are_invariant(rng, dtype):
    seqs = Seqs(rng, dtype)
    got = _per_row([seqs.every], lambda items: seqs.topk(ix.index_topk, items, "paged"))
    cache, bt, seq, pos = seqs.args(seqs.every, "paged")
    q = torch.stack([seqs.q[s][p] for s, p in seqs.every])
    w = torch.stack([seqs.w[s][p] for s, p in seqs.every])
    ref = index_scores_reference(q, w, cache, bt, seq, pos, KEY_OFF, D ** -0.5)
    for (s, p), r in zip(seqs.every, ref):
        sel = got[(s, p)]
        n = min(TOPK, p + 1)
        chosen = sel[sel >= 0]
        assert sel.dtype == torch.long and chosen.numel() == n and (sel[n:] == -1).all(), (s, p)
        assert torch.equal(chosen, chosen.sort().values), (s, p)
        out = torch.ones(p + 1, dtype=torch.bool)
        out[chosen] = False
        if out.any():
            assert float(r[chosen].min()) >= float(r[out].max()) - SCORE_TOL, (s, p)
    for what, layout, calls in seqs.compositions():
        other = _per_row(calls, lambda items: seqs.topk(ix.index_topk, items, layout))
        bad = [it for it in got if not torch.equal(other[it], got[it])]
        assert not bad, f"{what}: {len(bad)} rows differ, e.g. {bad[:3]}"


def test_index_topk_tie_rule_lowest_position_wins():
    """relu makes exact ties at 0 (every key whose dots are all negative): among equal scores
    the lowest positions win, as the reference's order and the CPU kernel's; -0 ties with +0."""
    n, k = 40, 12
    keys = torch.zeros(n, W)
    pos_score = torch.tensor([5, 9, 17, 30, 33])
    keys[:, KEY_OFF] = -1.0
    keys[pos_score, KEY_OFF] = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0])
    q = torch.zeros(1, H, D)
    q[0, :, 0] = 1.0
    w = torch.ones(1, H)
    cache, bt = keys.view(1, n, W), torch.zeros(1, 1, dtype=torch.long)
    args = (cache, bt, torch.tensor([0]), torch.tensor([n - 1]), KEY_OFF, 1.0, k)
    sel = ix.index_topk(q, w, *args)[0]
    zeros = [j for j in range(n) if j not in pos_score.tolist()][: k - 5]
    assert sel.tolist() == sorted(pos_score.tolist() + zeros)
    ref = topk_reference(index_scores_reference(q, w, *args[:-1])[0], k)
    assert torch.equal(sel, ref) and torch.equal(sel, ix_cpu.index_topk(q, w, *args)[0])
    sel = ix.index_topk(q, -w, torch.full((1, n, W), -1.0), *args[1:])[0]  # all -0 / +0
    assert sel.tolist() == list(range(k))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_attention_matches_reference_and_rows_are_invariant(rng, dtype):
    seqs = Seqs(rng, dtype)
    sets = _per_row([seqs.every], lambda items: seqs.topk(ix_cpu.index_topk, items, "paged"))
    got = seqs.attend(sa.sparse_mla_attention, seqs.every, "paged", sets)
    cache, bt, seq, _ = seqs.args(seqs.every, "paged")
    q = torch.stack([seqs.qa[s][p] for s, p in seqs.every])
    ind = torch.stack([sets[it] for it in seqs.every])
    ref = sparse_attention_reference(q, cache, bt, seq, ind, DQ ** -0.5, DV)
    assert got.dtype == dtype and got.shape == (len(seqs.every), HA, DV)
    scale = max(1.0, float(ref.float().abs().max())) if dtype == torch.bfloat16 else 1.0
    torch.testing.assert_close(got.float(), ref.float(), atol=ATTN_ATOL[dtype] * scale, rtol=0)
    base = dict(zip(seqs.every, got))
    for what, layout, calls in seqs.compositions():
        other = _per_row(calls, lambda items: seqs.attend(sa.sparse_mla_attention, items, layout, sets))
        bad = [it for it in base if not torch.equal(other[it], base[it])]
        assert not bad, f"{what}: {len(bad)} rows differ, e.g. {bad[:3]}"
    # a row with no selected position (a padding row): zeros
    empty = seqs.attend(sa.sparse_mla_attention, [(0, 3)], "paged", {(0, 3): torch.full((TOPK,), -1)})
    assert torch.equal(empty, torch.zeros_like(empty))
    if dtype == torch.float32:  # the backward is the eager function's gradient
        q_, qe = q[:20].clone().requires_grad_(), q[:20].clone().requires_grad_()
        up = torch.randn(20, HA, DV, generator=rng)
        (sa.sparse_mla_attention(q_, cache, bt, seq[:20], ind[:20], DQ ** -0.5, DV) * up).sum().backward()
        (sparse_attention_eager(qe, cache, bt, seq[:20], ind[:20], DQ ** -0.5, DV) * up).sum().backward()
        assert torch.equal(q_.grad, qe.grad)


def test_dispatcher_runs_the_triton_forms(rng):
    """Under use_backend("triton") the dispatched GLM-5 ops reach these modules."""
    x, w, b = torch.randn(3, 70, generator=rng), torch.randn(70, generator=rng), torch.randn(70, generator=rng)
    with dispatch.use_backend("triton"):
        for op, mod in (("index_topk", ix), ("sparse_mla_attention", sa), ("layer_norm", ln),
                        ("router_sigmoid_topk", mo)):
            assert dispatch.implementation(op, "cpu").__module__ == mod.__name__, op
        assert torch.equal(K.layer_norm(x, w, b, 1e-6), ln.layer_norm(x, w, b, 1e-6))


def test_reads_outside_the_cache_are_refused(rng):
    seqs = Seqs(rng, torch.float32, lens=[9, 4])
    cache, bt, seq, pos = seqs.args([(1, 3)], "paged")
    with pytest.raises(ValueError, match="outside"):  # past the block-table row
        ix.index_topk(seqs.q[1][3:4], seqs.w[1][3:4], cache, bt, seq, torch.tensor([40]), KEY_OFF, 1.0, TOPK)
    bad_bt = bt.clone()
    bad_bt[1, 0] = cache.shape[0]  # a page number past the cache
    with pytest.raises(ValueError, match="outside the cache"):
        ix.index_topk(seqs.q[1][3:4], seqs.w[1][3:4], cache, bad_bt, seq, pos, KEY_OFF, 1.0, TOPK)
    ind = torch.tensor([[0, 2, 3, -1, -1]])
    with pytest.raises(ValueError, match="outside the cache"):
        sa.sparse_mla_attention(seqs.qa[1][3:4], cache, bad_bt, seq, ind, 1.0, DV)
    with pytest.raises(ValueError, match="outside"):
        sa.sparse_mla_attention(seqs.qa[1][3:4], cache, bt, seq, ind + 40, 1.0, DV)


def test_glm5_model_on_the_triton_column(rng, monkeypatch):
    """A tiny GLM-5 (hidden 70, 101 tokens, top-k 5 of 11 positions, 5 experts) with every op on
    the dispatcher's Triton column: a sequence's logits are the same bits alone as in a batch,
    within fp32 rounding of the CPU column's; the contract names the Triton forms; the
    trainer's backward runs through them."""
    from titan_rl import contract
    from titan_rl.models.glm_moe_dsa.config import GlmDsaConfig
    from titan_rl.models.options import ModelOptions
    from titan_rl.titan.spec import model_config

    cfg = GlmDsaConfig(vocab_size=101, hidden_size=70, intermediate_size=72, num_hidden_layers=2,
                       mlp_layer_types=("dense", "sparse"), indexer_types=("full", "full"), index_topk=5)
    m = model_config("glm_moe_dsa", "debug_glm5", ModelOptions(), model_config=cfg).build()
    m.init_weights(seed=int(torch.randint(0, 2**31, (1,), generator=rng)), std=0.05)
    tokens = torch.randint(0, 101, (2, 11), generator=rng)
    with torch.no_grad():
        cpu = m(tokens)
        with dispatch.use_backend("triton"):
            both = m(tokens)
            alone = m(tokens[1:])
    assert torch.equal(alone, both[1:])
    # fp32 GEMMs, norms and softmaxes in other orders: a few ulps of |logit| <= ~2 per op
    torch.testing.assert_close(both, cpu, atol=2e-5, rtol=0)
    monkeypatch.setattr(contract, "check_platform", lambda *a, **k: None)  # the probe: gpu_check.py's
    with dispatch.use_backend("triton"):
        e = contract.contract_of(m).entries()
        assert e["op.index_topk"] == "titan_rl.kernels.indexer.triton_impl.index_topk"
        assert e["op.sparse_attention"] == "titan_rl.kernels.sparse_attention.triton_impl.sparse_mla_attention"
        assert e["op.layer_norm"] == "titan_rl.kernels.layernorm.triton_impl.layer_norm"
        m(tokens[:1, :7]).float().logsumexp(-1).mean().backward()
    grads = [p.grad for p in m.parameters() if p.requires_grad]
    assert all(g is None or torch.isfinite(g).all() for g in grads) and any(
        g is not None and g.abs().sum() > 0 for g in grads)
