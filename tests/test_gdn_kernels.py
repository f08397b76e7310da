"""Gated delta rule (kernels/gdn): each function against its float64 reference at a stated
tolerance, and the exact path's invariance with torch.equal (never allclose) on fresh
random inputs: prefill + decode at every split, chunked-prefill splits, batched == alone
at any position, varlen == separate calls, 1 vs 2 threads."""


import pytest
import torch
import torch.nn.functional as F

from titan_rl.kernels.gdn import (
    causal_conv1d,
    causal_conv1d_reference,
    gdn_chunked,
    gdn_recurrent,
    gdn_reference,
    l2norm,
    lane_stable,
)

DTYPES = [torch.float32, torch.bfloat16]
# Tolerances vs the float64 references, each a few times above the max measured over 40
# seeds at these shapes (scripts in docs/gdn.md; |o| up to ~4, |state| up to ~5):
#   exact recurrent fp32: o 7.8e-8, state 2.7e-7  -> atol 5e-7 (o), 2e-6 (state).
#   bf16 inputs: the same fp32 arithmetic on bf16 values, then o is rounded to bf16
#   (relative error <= 2^-9): rtol 2^-8 on o (measured 9.8e-4 abs); state as fp32.
#   chunked fp32 (GEMMs + triangular solve, chunk 4..64): o 6.4e-7, state 3.9e-6
#   -> atol 3e-6 (o), 2e-5 (state).
#   causal_conv1d fp32: 5.7e-7 -> atol 3e-6; bf16 output rounding: rtol 2^-8.
#   gradients (exact forward, chunked backward, fp32; |grad| up to ~13): 1.6e-5 abs
#   -> atol 1e-4 + rtol 1e-4.
O_TOL = {torch.float32: dict(rtol=0.0, atol=5e-7), torch.bfloat16: dict(rtol=2**-8, atol=1e-5)}
STATE_TOL = dict(rtol=0.0, atol=2e-6)
CHUNK_O_TOL, CHUNK_STATE_TOL = dict(rtol=0.0, atol=3e-6), dict(rtol=0.0, atol=2e-5)
CONV_TOL = {torch.float32: dict(rtol=0.0, atol=3e-6), torch.bfloat16: dict(rtol=2**-8, atol=1e-5)}
GRAD_ATOL, GRAD_RTOL = 1e-4, 1e-4


from _threads import threads  # noqa: E402  (the real setter: tests/_threads.py)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.long).cumsum(0).tolist(), dtype=torch.long)


def _gdn_inputs(rng, lens, Hk=2, Hv=4, dk=16, dv=16, dtype=torch.float32, init=True):
    """q/k L2-normalised, g = -softplus (log decay <= 0, some strong), beta = sigmoid."""
    T = sum(lens)
    q = l2norm(torch.randn(T, Hk, dk, generator=rng)).to(dtype)
    k = l2norm(torch.randn(T, Hk, dk, generator=rng)).to(dtype)
    v = torch.randn(T, Hv, dv, generator=rng).to(dtype)
    g = -lane_stable(F.softplus, 2 * torch.randn(T, Hv, generator=rng))
    beta = lane_stable(torch.sigmoid, 2 * torch.randn(T, Hv, generator=rng))
    s0 = 0.3 * torch.randn(len(lens), Hv, dk, dv, generator=rng) if init else None
    return q, k, v, g, beta, _cu(lens), s0


def _take(x, cu, i):
    return x[int(cu[i]):int(cu[i + 1])]


def _eq(a, b):
    return a.shape == b.shape and torch.equal(a, b)


# -- lane_stable ------------------------------------------------------------------------

FNS = {"exp": torch.exp, "sigmoid": torch.sigmoid, "softplus": F.softplus, "silu": F.silu}


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_lane_stable_rows_do_not_depend_on_slicing_size_or_threads(name, dtype, rng):
    fn = FNS[name]
    x = (3 * torch.randn(300, 70, generator=rng)).to(dtype)
    full = lane_stable(fn, x)
    assert full.dtype == torch.float32
    torch.testing.assert_close(full, fn(x.float()), rtol=1e-6, atol=1e-7)
    for i, j in [(0, 1), (1, 2), (5, 10), (7, 8), (3, 67), (0, 299), (150, 300), (299, 300)]:
        assert _eq(lane_stable(fn, x[i:j]), full[i:j]), (i, j)
    assert _eq(lane_stable(fn, x[:, :5])[:, :5], lane_stable(fn, x[:, :5].contiguous()))
    # column slices are rows of another width: same per-element bits
    assert _eq(lane_stable(fn, x[:, 3:9]), full[:, 3:9])
    assert _eq(lane_stable(fn, x.reshape(-1, 7)).reshape(300, 70), full)
    with threads(1):
        assert _eq(lane_stable(fn, x), full)
    # > ATen's grain: threaded, several pieces of either size (1000 x 192 after the padding);
    # 3 threads cut a piece unevenly unless its size keeps the cut on ATen's grain
    big = (3 * torch.randn(1000, 130, generator=rng)).to(dtype)
    fb = lane_stable(fn, big)
    for n in (1, 3, 4):
        with threads(n):
            assert _eq(lane_stable(fn, big), fb), n
            assert _eq(lane_stable(fn, big[:700]), fb[:700]), n
    for i in (0, 1, 517):
        assert _eq(lane_stable(fn, big[i:i + 3]), fb[i:i + 3])


def test_plain_transcendentals_tail_can_differ_from_vector_lanes(rng):
    """Why lane_stable exists: a plain call on a 5-element tensor runs the scalar tail,
    which can differ from the value the same element gets inside a 64-element (vector)
    buffer. Observed on the project's CPUs for sigmoid, silu and softplus (~4-14% of
    elements) in fp32; NOT observed for exp (MKL VML path), which lane_stable still
    handles the same way."""
    for name in ("sigmoid", "silu", "softplus"):
        fn = FNS[name]
        found = False
        for _ in range(400):
            x = 3 * torch.randn(64, generator=rng)
            if not torch.equal(fn(x[:5].clone()), fn(x)[:5]):
                found = True
                break
        assert found, f"{name}: no 5-element call differed from its 64-element value"
        # lane_stable agrees whatever the size
        assert _eq(lane_stable(fn, x[:5].clone()), lane_stable(fn, x)[:5])


# -- l2norm -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_matches_reference_and_is_row_invariant(dtype, rng):
    for d in (16, 24, 128):
        x = torch.randn(50, 3, d, generator=rng).to(dtype)
        y = l2norm(x)
        assert y.dtype == torch.float32
        xd = x.double()
        ref = xd / torch.sqrt((xd * xd).sum(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-7)
        for i, j in ((0, 1), (3, 4), (10, 49)):
            assert _eq(l2norm(x[i:j]), y[i:j])
        assert _eq(l2norm(x.reshape(150, d)).reshape(50, 3, d), y)


# -- gdn_recurrent: the exact path ------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_recurrent_matches_reference(dtype, rng):
    for lens, Hk, Hv, dk, dv in [([5, 0, 17, 3, 30], 2, 4, 16, 16), ([9, 1], 1, 2, 12, 8), ([20], 2, 2, 32, 16)]:
        q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, lens, Hk, Hv, dk, dv, dtype)
        for init in (s0, None):
            o, s = gdn_recurrent(q, k, v, g, beta, cu, init)
            assert o.dtype == dtype and s.dtype == torch.float32 and s.shape == (len(lens), Hv, dk, dv)
            ro, rs = gdn_reference(q, k, v, g, beta, cu, init)
            torch.testing.assert_close(o.double(), ro, **O_TOL[dtype])
            torch.testing.assert_close(s.double(), rs, **STATE_TOL)
    # a length-0 sequence keeps its initial state exactly
    i0 = 1
    assert torch.equal(gdn_recurrent(q, k, v, g, beta, _cu([20, 0]), torch.cat([s0[:1], s0[:1]]))[1][i0], s0[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_prefill_plus_decode_every_split(dtype, rng):
    L = 24
    q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, [L], dtype=dtype)
    for init in (s0, None):
        full_o, full_s = gdn_recurrent(q, k, v, g, beta, cu, init)
        for s in range(L + 1):
            o, st = gdn_recurrent(q[:s], k[:s], v[:s], g[:s], beta[:s], _cu([s]), init)
            outs = [o]
            for t in range(s, L):  # token-by-token decode, state fed back
                o, st = gdn_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], _cu([1]), st)
                outs.append(o)
            assert _eq(torch.cat(outs), full_o), s
            assert _eq(st, full_s), s


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_chunked_prefill_splits(dtype, rng):
    L = 40
    q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, [L], dtype=dtype)
    full_o, full_s = gdn_recurrent(q, k, v, g, beta, cu, s0)
    for _ in range(12):
        ncut = int(torch.randint(1, 3, (1,), generator=rng))
        cuts = sorted(torch.randint(0, L + 1, (ncut,), generator=rng).tolist())
        bounds = [0] + cuts + [L]
        st, outs = s0, []
        for a, b in zip(bounds[:-1], bounds[1:]):
            o, st = gdn_recurrent(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], _cu([b - a]), st)
            outs.append(o)
        assert _eq(torch.cat(outs), full_o), bounds
        assert _eq(st, full_s), bounds


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_batched_equals_single_at_any_position(dtype, rng):
    """A sequence alone vs packed with up to 15 others of different lengths, at every
    position in the pack; and a whole varlen pack vs each sequence run separately."""
    pool = [int(n) for n in torch.randint(0, 33, (16,), generator=rng)]
    pool[0] = 29
    q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, pool, dtype=dtype)
    alone = []
    for i in range(len(pool)):
        sl = lambda x: _take(x, cu, i)  # noqa: E731
        alone.append(gdn_recurrent(sl(q), sl(k), sl(v), sl(g), sl(beta), _cu([pool[i]]), s0[i:i + 1]))
    for order in ([0], list(range(16)), list(range(15, -1, -1)), [3, 0, 7], [5, 9, 0, 1, 2, 11],
                  torch.randperm(16, generator=rng).tolist(), torch.randperm(16, generator=rng)[:9].tolist()):
        cat = lambda x: torch.cat([_take(x, cu, i) for i in order])  # noqa: E731
        lens = [pool[i] for i in order]
        o, s = gdn_recurrent(cat(q), cat(k), cat(v), cat(g), cat(beta), _cu(lens), s0[order])
        pcu = _cu(lens)
        for j, i in enumerate(order):
            assert _eq(_take(o, pcu, j), alone[i][0]), (order, i)
            assert _eq(s[j], alone[i][1][0]), (order, i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_mixed_prefill_and_decode_batch(dtype, rng):
    """vLLM-style step: decodes (length 1, with state) and prefills in one stream."""
    lens = [13, 7, 20]
    q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, lens, dtype=dtype)
    full_o, full_s = gdn_recurrent(q, k, v, g, beta, cu, s0)
    # step 1: prefill the first 12 / 0 / 5 tokens; step 2: 1 (decode) / 7 / 15
    p = [12, 0, 5]
    cut = lambda x, a, b: torch.cat([_take(x, cu, i)[a[i]:b[i]] for i in range(3)])  # noqa: E731
    zero, end = [0, 0, 0], lens
    o1, st = gdn_recurrent(*(cut(x, zero, p) for x in (q, k, v, g, beta)), _cu(p), s0)
    o2, st = gdn_recurrent(*(cut(x, p, end) for x in (q, k, v, g, beta)), _cu([a - b for a, b in zip(end, p)]), st)
    assert _eq(st, full_s)
    c1, c2 = _cu(p), _cu([a - b for a, b in zip(end, p)])
    for i in range(3):
        assert _eq(torch.cat([_take(o1, c1, i), _take(o2, c2, i)]), _take(full_o, cu, i)), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_threads_one_vs_two(dtype, rng):
    # N * Hv * dv * dk = 16 * 4 * 32 * 32 = 65536 state elements: large enough for ATen to
    # split the elementwise ops across threads.
    lens = [int(n) for n in torch.randint(1, 12, (16,), generator=rng)]
    q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, lens, 2, 4, 32, 32, dtype)
    with threads(2):
        o2, s2 = gdn_recurrent(q, k, v, g, beta, cu, s0)
    with threads(1):
        o1, s1 = gdn_recurrent(q, k, v, g, beta, cu, s0)
    assert _eq(o1, o2) and _eq(s1, s2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_step_is_the_torch_forms_bits(dtype, rng):
    """csrc/gdn_recurrent.cpp (what gdn_recurrent runs on CPU with an fp32 state) against the
    torch form it is pinned to (`_recurrent_forward_torch`), torch.equal: odd widths (dk 7 and
    24, padded to 8 and 32; dv 20 and 33, not whole vectors), 3 value heads per key head,
    sequences of length 0, with and without an initial state, at 1 and 2 threads."""
    from titan_rl.kernels.cpu_ext import ops
    from titan_rl.kernels.gdn import torch_impl

    for lens, Hk, Hv, dk, dv in [([5, 0, 17, 3], 2, 6, 24, 20), ([1, 1, 1, 1], 1, 3, 7, 33), ([40, 9], 2, 2, 16, 16)]:
        q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, lens, Hk, Hv, dk, dv, dtype)
        scale = dk ** -0.5
        for init in (s0, None):
            want_o, want_s = torch_impl._recurrent_forward_torch(q, k, v, g, beta, cu, init, scale)
            for n in (1, 2):
                with threads(n):
                    o, s = torch_impl._recurrent_forward(q, k, v, g, beta, cu, init, scale)
                    raw_o, raw_s = ops().gdn_recurrent_f32(
                        *(x.float().contiguous() for x in (q, k, v, lane_stable(torch.exp, g.float()), beta)), cu,
                        torch.empty(0) if init is None else init, scale)
                assert _eq(o, want_o) and _eq(s, want_s), (lens, dk, dv, n, init is None)
                assert _eq(raw_o.to(dtype), want_o) and _eq(raw_s, want_s), (lens, dk, dv, n, init is None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_states_in_cache_rows_are_the_gathered_states_bits(dtype, rng):
    """A CacheRows initial state (an engine's cache, updated in place by the compiled step and
    conv; the other forms gather, run and store) against the same states passed as a tensor, torch.equal:
    o, every written row, and every other row untouched. Rows lie a stride apart that is not the
    row's size, in shuffled order; some sequences have no context (their row holds a stranger's
    leftovers, which must be ignored), some have length 0; odd widths; 1 and 2 threads."""
    from titan_rl.kernels.gdn import CacheRows
    from titan_rl.kernels.gdn import torch_impl

    for lens, Hk, Hv, dk, dv in [([5, 0, 17, 3], 2, 6, 24, 20), ([1, 1, 1, 1, 1], 1, 3, 7, 33), ([40, 9], 2, 2, 16, 16)]:
        q, k, v, g, beta, cu, _ = _gdn_inputs(rng, lens, Hk, Hv, dk, dv, dtype)
        N, R = len(lens), 2 * len(lens) + 3
        buf = torch.randn(R, Hv * dk * dv + 5, generator=rng)  # a row's stride is not its size
        rows = torch.randperm(R, generator=rng)[:N]
        has_context = torch.rand(N, generator=rng) < 0.6
        has_context[0], has_context[-1] = True, False  # both kinds, whatever the draw
        for form in (gdn_recurrent, gdn_chunked):
            cache = buf.clone()[:, :Hv * dk * dv].view(R, Hv, dk, dv)
            before = cache.clone()
            init = torch.where(has_context.view(-1, 1, 1, 1), before[rows], 0.0)
            want_o, want_s = form(q, k, v, g, beta, cu, init)
            for n in (1, 2):
                cache.copy_(before)
                with threads(n):
                    o, got = form(q, k, v, g, beta, cu, CacheRows(cache, rows, has_context))
                assert isinstance(got, CacheRows) and _eq(o, want_o), (lens, form.__name__, n)
                assert _eq(cache[rows], want_s), (lens, form.__name__, n)
                others = torch.ones(R, dtype=torch.bool)
                others[rows] = False
                assert _eq(cache[others], before[others]), (lens, form.__name__, n)
        # the in-place step is what the CPU fp32 path takes (the other forms gather and store)
        assert CacheRows(cache, rows, has_context).in_place(v)
        # the conv states the same way (widths 4 and 3: 77 and 6 channels, rows a stride apart)
        for C, K in [(77, 4), (6, 3)]:
            x = torch.randn(sum(lens), C, generator=rng).to(dtype)
            w = torch.randn(C, 1, K, generator=rng)
            cbuf = torch.randn(R, C * (K - 1) + 3, generator=rng)
            for form in (causal_conv1d, torch_impl.causal_conv1d_torch):
                cache = cbuf.clone()[:, :C * (K - 1)].view(R, C, K - 1)
                before = cache.clone()
                want_y, want_s = form(x, w, cu, torch.where(has_context.view(-1, 1, 1), before[rows], 0.0))
                for n in (1, 2):
                    cache.copy_(before)
                    with threads(n):
                        y, got = form(x, w, cu, CacheRows(cache, rows, has_context))
                    assert isinstance(got, CacheRows) and _eq(y, want_y) and _eq(cache[rows], want_s), (C, K, n)
                    others = torch.ones(R, dtype=torch.bool)
                    others[rows] = False
                    assert _eq(cache[others], before[others])


def test_states_in_cache_rows_refuse_what_they_cannot_be(rng):
    from titan_rl.kernels.gdn import CacheRows

    cache = torch.zeros(4, 2, 8, 8)
    with pytest.raises(ValueError, match="distinct rows of the cache"):
        CacheRows(cache, torch.tensor([1, 1]), torch.tensor([True, True]))
    with pytest.raises(ValueError, match="distinct rows of the cache"):
        CacheRows(cache, torch.tensor([0, 4]), torch.tensor([True, True]))
    q, k, v, g, beta, cu, _ = _gdn_inputs(rng, [3, 2], 1, 2, 8, 8)
    with pytest.raises(ValueError, match="not a differentiable input"):
        gdn_recurrent(q.requires_grad_(), k, v, g, beta, cu, CacheRows(cache, torch.tensor([0, 2]),
                                                                       torch.tensor([True, False])))


def test_gdn_recurrent_autograd_path_has_the_same_forward_bits(rng):
    q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, [6, 11])
    o, s = gdn_recurrent(q, k, v, g, beta, cu, s0)
    og, sg = gdn_recurrent(q.requires_grad_(), k, v, g, beta, cu, s0)
    assert og.requires_grad and _eq(og.detach(), o) and _eq(sg.detach(), s)


# -- chunked form -----------------------------------------------------------------------

def test_gdn_chunked_matches_reference(rng):
    for lens, Hk, Hv, dk, dv in [([5, 0, 17, 3, 40], 2, 4, 16, 16), ([64, 1], 1, 2, 32, 16)]:
        q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, lens, Hk, Hv, dk, dv)
        for init in (s0, None):
            ro, rs = gdn_reference(q, k, v, g, beta, cu, init)
            for C in (4, 16, 64):
                o, s = gdn_chunked(q, k, v, g, beta, cu, init, chunk_size=C)
                assert o.dtype == torch.float32 and s.dtype == torch.float32
                torch.testing.assert_close(o.double(), ro, **CHUNK_O_TOL)
                torch.testing.assert_close(s.double(), rs, **CHUNK_STATE_TOL)


# -- backward ---------------------------------------------------------------------------

@pytest.mark.parametrize("with_init", [True, False])
def test_gdn_recurrent_grads_match_reference(with_init, rng):
    q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, [5, 0, 17, 3, 30], init=with_init)
    base = [q, k, v, g, beta] + ([s0] if with_init else [])
    xs = [t.clone().requires_grad_() for t in base]
    o, s = gdn_recurrent(*xs[:5], cu, xs[5] if with_init else None)
    go, gs = torch.randn(o.shape, generator=rng), torch.randn(s.shape, generator=rng)
    ((o * go).sum() + (s * gs).sum()).backward()
    rs = [t.double().requires_grad_() for t in base]
    ro, rst = gdn_reference(*rs[:5], cu, rs[5] if with_init else None)
    ((ro * go.double()).sum() + (rst * gs.double()).sum()).backward()
    for name, a, b in zip("q k v g beta s0".split(), xs, rs):
        assert a.grad.dtype == a.dtype
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_gdn_recurrent_gradcheck_fp64():
    g64 = torch.Generator().manual_seed(0)
    d = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g64)  # noqa: E731
    T, cu = 5, torch.tensor([0, 2, 2, 5])
    ins = [l2norm(d(T, 1, 2)), l2norm(d(T, 1, 2)), d(T, 2, 2), -F.softplus(d(T, 2)), torch.sigmoid(d(T, 2)),
           d(3, 2, 2, 2)]
    ins = [t.requires_grad_() for t in ins]
    assert torch.autograd.gradcheck(lambda a, b, c, e, f, h: gdn_recurrent(a, b, c, e, f, cu, h, chunk_size=2), ins)


def test_gdn_recurrent_bf16_backward_runs(rng):
    q, k, v, g, beta, cu, s0 = _gdn_inputs(rng, [7, 9], dtype=torch.bfloat16)
    xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o, s = gdn_recurrent(*xs, cu, s0)
    o.float().square().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == x.dtype and torch.isfinite(x.grad).all() for x in xs)


# -- causal_conv1d ----------------------------------------------------------------------

def _conv_inputs(rng, lens, C=24, K=4, dtype=torch.float32):
    x = torch.randn(sum(lens), C, generator=rng).to(dtype)
    w = (0.5 * torch.randn(C, 1, K, generator=rng)).to(dtype)
    s0 = torch.randn(len(lens), C, K - 1, generator=rng)
    return x, w, _cu(lens), s0


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_matches_reference(dtype, rng):
    for K in (4, 2, 1):
        x, w, cu, s0 = _conv_inputs(rng, [5, 0, 2, 1, 17], K=K, dtype=dtype)
        for init in (s0, None):
            y, s = causal_conv1d(x, w, cu, init)
            assert y.dtype == dtype and s.dtype == torch.float32 and s.shape == (5, 24, K - 1)
            ry, rs = causal_conv1d_reference(x, w, cu, init)
            torch.testing.assert_close(y.double(), ry, **CONV_TOL[dtype])
            assert torch.equal(s.double(), rs)  # the state is a copy of inputs
            assert _eq(causal_conv1d(x, w[:, 0], cu, init)[0], y)  # [C, K] layout


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_every_split_and_chunked_prefill(dtype, rng):
    L = 20
    x, w, cu, s0 = _conv_inputs(rng, [L], dtype=dtype)
    for init in (s0, None):
        full_y, full_s = causal_conv1d(x, w, cu, init)
        for s in range(L + 1):
            y, st = causal_conv1d(x[:s], w, _cu([s]), init)
            ys = [y]
            for t in range(s, L):
                y, st = causal_conv1d(x[t:t + 1], w, _cu([1]), st)
                ys.append(y)
            assert _eq(torch.cat(ys), full_y) and _eq(st, full_s), s
        for _ in range(10):
            cuts = sorted(torch.randint(0, L + 1, (int(torch.randint(1, 3, (1,), generator=rng)),),
                                        generator=rng).tolist())
            b = [0] + cuts + [L]
            st, ys = init, []
            for lo, hi in zip(b[:-1], b[1:]):
                y, st = causal_conv1d(x[lo:hi], w, _cu([hi - lo]), st)
                ys.append(y)
            assert _eq(torch.cat(ys), full_y) and _eq(st, full_s), b


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_batched_equals_single_and_threads(dtype, rng):
    pool = [int(n) for n in torch.randint(0, 30, (16,), generator=rng)]
    x, w, cu, s0 = _conv_inputs(rng, pool, C=160, dtype=dtype)  # 160 * T > ATen's grain: threaded
    alone = [causal_conv1d(_take(x, cu, i), w, _cu([pool[i]]), s0[i:i + 1]) for i in range(16)]
    for order in (list(range(16)), list(range(15, -1, -1)), [4], [2, 9, 0],
                  torch.randperm(16, generator=rng)[:7].tolist()):
        lens = [pool[i] for i in order]
        pcu = _cu(lens)
        xx = torch.cat([_take(x, cu, i) for i in order])
        for n in (1, 2):
            with threads(n):
                y, s = causal_conv1d(xx, w, pcu, s0[order])
            for j, i in enumerate(order):
                assert _eq(_take(y, pcu, j), alone[i][0]) and _eq(s[j], alone[i][1][0]), (order, i, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_final_state_alone_is_the_convs_final_state(dtype, rng):
    """The Triton conv takes its final state from conv_final_state (a gather of each
    sequence's last K-1 inputs): the same bits, and the same gradients, as the torch conv's,
    with sequences shorter than K-1 reaching into their initial state or zeros."""
    from titan_rl.kernels.gdn.torch_impl import conv_final_state

    for K in (4, 2, 1):
        for lens in ([5, 0, 2, 1, 17], [0], [1, 2], [0, 0, 3]):
            x, w, cu, s0 = _conv_inputs(rng, lens, C=37, K=K, dtype=dtype)
            for init in (s0, None):
                want = causal_conv1d(x, w, cu, init)[1]
                assert _eq(conv_final_state(x, cu, K, init), want), (K, lens, init is None)
    x, w, cu, s0 = _conv_inputs(rng, [5, 0, 2, 1, 9], C=37, dtype=dtype)
    grads = []
    for final in (lambda a, b: conv_final_state(a, cu, 4, b), lambda a, b: causal_conv1d(a, w, cu, b)[1]):
        xs = [x.clone().requires_grad_(), s0.clone().requires_grad_()]
        (final(*xs) * torch.arange(3.0)).sum().backward()
        grads.append([t.grad for t in xs])
    assert all(_eq(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_conv_is_the_torch_forms_bits(dtype, rng):
    """csrc/causal_conv1d.cpp (what causal_conv1d runs on CPU) against the torch form it is pinned
    to (`causal_conv1d_torch`), torch.equal, y and the final state: odd channel counts (77, 200:
    blocks of 128 with a tail), conv widths 1 to 4, sequences of length 0 and shorter than the
    history, with and without an initial state, 1 and 2 threads; and its gradients are the torch
    form's (its backward recomputes that form)."""
    from titan_rl.kernels.gdn import torch_impl

    for C, K, lens in [(77, 4, [5, 0, 2, 9, 1]), (200, 3, [1, 1, 1]), (130, 2, [13]), (33, 1, [4, 0, 2])]:
        T = sum(lens)
        x = torch.randn(T, C, generator=rng).to(dtype)
        w = torch.randn(C, 1, K, generator=rng).to(dtype)
        cu = _cu(lens)
        s0 = torch.randn(len(lens), C, K - 1, generator=rng)
        for init in (s0, None):
            want = torch_impl.causal_conv1d_torch(x, w, cu, init)
            for n in (1, 2):
                with threads(n):
                    got = causal_conv1d(x, w, cu, init)
                assert _eq(got[0], want[0]) and _eq(got[1], want[1]), (C, K, lens, n, init is None)
        gy = torch.randn(T, C, generator=rng)
        grads = []
        for form in (causal_conv1d, torch_impl.causal_conv1d_torch):
            xs = [t.clone().requires_grad_() for t in (x, w, s0)]
            y, s = form(xs[0], xs[1], cu, xs[2])
            ((y.float() * gy).sum() + s.sum()).backward()
            grads.append([t.grad for t in xs])
        assert all((a is None and b is None) or _eq(a, b) for a, b in zip(*grads)), (C, K, lens)
        assert grads[0][0] is not None and grads[0][1] is not None


def test_causal_conv1d_grads_match_reference(rng):
    x, w, cu, s0 = _conv_inputs(rng, [5, 0, 2, 9])
    xs = [t.clone().requires_grad_() for t in (x, w, s0)]
    y, s = causal_conv1d(xs[0], xs[1], cu, xs[2])
    gy = torch.randn(y.shape, generator=rng)
    ((y * gy).sum() + s.sum()).backward()
    rs = [t.double().requires_grad_() for t in (x, w, s0)]
    ry, rst = causal_conv1d_reference(rs[0], rs[1], cu, rs[2])
    ((ry * gy.double()).sum() + rst.sum()).backward()
    for a, b in zip(xs, rs):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-5)


# -- Triton (kernels/gdn/triton_impl.py) under TRITON_INTERPRET=1 ------------------------

_TRITON_CHECK = r"""
import sys, torch
from titan_rl.kernels.gdn import triton_impl as ti, gdn_reference, l2norm
rng = torch.Generator().manual_seed(int(sys.argv[1]))
lens = [3, 0, 6, 1, 4]
cu = torch.tensor([0, 3, 3, 9, 10, 14]); T, Hk, Hv, dk, dv = 14, 1, 2, 12, 20  # dk, dv not block multiples
q = l2norm(torch.randn(T, Hk, dk, generator=rng)); k = l2norm(torch.randn(T, Hk, dk, generator=rng))
v = torch.randn(T, Hv, dv, generator=rng)
g = -torch.nn.functional.softplus(2 * torch.randn(T, Hv, generator=rng)); b = torch.rand(T, Hv, generator=rng)
s0 = 0.3 * torch.randn(5, Hv, dk, dv, generator=rng)
o, s = ti.gdn_recurrent(q, k, v, g, b, cu, s0)
ro, rs = gdn_reference(q, k, v, g, b, cu, s0)
torch.testing.assert_close(o.double(), ro, rtol=0, atol=5e-7)
torch.testing.assert_close(s.double(), rs, rtol=0, atol=2e-6)
for i in range(5):  # batched == alone
    a, e = int(cu[i]), int(cu[i + 1])
    oi, si = ti.gdn_recurrent(q[a:e], k[a:e], v[a:e], g[a:e], b[a:e], torch.tensor([0, e - a]), s0[i:i + 1])
    assert torch.equal(oi, o[a:e]) and torch.equal(si[0], s[i]), i
for p in (0, 2, 5):  # prefill p tokens of sequence 2, then decode
    st, outs = s0[2:3], []
    for lo, hi in [(3, 3 + p)] + [(t, t + 1) for t in range(3 + p, 9)]:
        oo, st = ti.gdn_recurrent(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], b[lo:hi], torch.tensor([0, hi - lo]), st)
        outs.append(oo)
    assert torch.equal(torch.cat(outs), o[3:9]) and torch.equal(st[0], s[2]), p
# the causal conv: torch_impl's bits (the same products summed in the same tap order), alone ==
# batched, chunked == one call; C = 37 and widths not multiples of the blocks
from titan_rl.kernels.gdn import torch_impl as tt
C = 37
for dt in (torch.float32, torch.bfloat16):
    for K, with_s0 in ((4, True), (4, False), (2, True), (1, False)):
        x = torch.randn(T, C, generator=rng).to(dt)
        w = torch.randn(C, 1, K, generator=rng).to(dt)
        c0 = torch.randn(5, C, K - 1, generator=rng) if with_s0 else None
        y, f = ti.causal_conv1d(x, w, cu, c0)
        ry, rf = tt.causal_conv1d(x, w, cu, c0)
        assert y.dtype == dt and torch.equal(y, ry) and torch.equal(f, rf), (dt, K, with_s0)
        for i in range(5):
            a, e = int(cu[i]), int(cu[i + 1])
            yi, fi = ti.causal_conv1d(x[a:e], w, torch.tensor([0, e - a]), None if c0 is None else c0[i:i + 1])
            assert torch.equal(yi, y[a:e]) and torch.equal(fi[0], f[i]), (dt, K, i)
        st, outs = (None if c0 is None else c0[2:3]), []
        for lo, hi in ((3, 5), (5, 6), (6, 9)):  # sequence 2 in three calls, the state handed over
            yy, st = ti.causal_conv1d(x[lo:hi], w, torch.tensor([0, hi - lo]), st)
            outs.append(yy)
        assert torch.equal(torch.cat(outs), y[3:9]) and torch.equal(st[0], f[2]), (dt, K)
xs = [torch.randn(T, C, generator=rng), torch.randn(C, 4, generator=rng), torch.randn(5, C, 3, generator=rng)]
ups = torch.randn(T, C, generator=rng), torch.randn(5, C, 3, generator=rng)
grads = []
for form in (ti, tt):  # the backward is torch_impl's gradient (summed in another order: close)
    leaves = [t.clone().requires_grad_() for t in xs]
    y, f = form.causal_conv1d(leaves[0], leaves[1], cu, leaves[2])
    ((y * ups[0]).sum() + (f * ups[1]).sum()).backward()
    grads.append([t.grad for t in leaves])
for a, e in zip(*grads):
    torch.testing.assert_close(a, e, rtol=0, atol=1e-5)
# the L2 norm: within an ulp or two of fp64, rows alone == batched, any leading shape
for dt in (torch.float32, torch.bfloat16):
    for D in (1, 37, 128):
        x = torch.randn(9, 3, D, generator=rng).to(dt)
        y = ti.l2norm(x)
        ref = x.double() / torch.sqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=4e-7)
        assert torch.equal(ti.l2norm(x[4:5, 1:2]), y[4:5, 1:2])
        assert torch.equal(ti.l2norm(x.reshape(-1, D)), y.reshape(-1, D))
x = torch.randn(6, 2, 37, generator=rng)
up = torch.randn(6, 2, 37, generator=rng)
xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
(ti.l2norm(xa) * up).sum().backward()
(tt.l2norm(xb) * up).sum().backward()
assert torch.equal(xa.grad, xb.grad)  # the same eager gradient
print("ok")
"""


def test_triton_gdn_recurrent_conv_and_l2norm_in_interpreter(rng):
    """Tiny shapes, in a child process (TRITON_INTERPRET must be set before triton is first
    imported): the recurrence (fp32) close to the reference at the exact path's tolerances;
    the conv (fp32, bf16) torch_impl's bits; the L2 norm close to fp64; and for each batched
    == alone, prefill + decode == one call, with torch.equal."""
    import os
    import subprocess
    import sys

    pytest.importorskip("numpy")
    pytest.importorskip("triton")
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _TRITON_CHECK, str(seed)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"seed={seed}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
