"""Each kernel against its reference (closeness, stated tolerance) and its invariance
(torch.equal) on fresh random inputs."""

import math

import pytest
import torch

from titan_rl.kernels import attention_dense, attention_paged, linear, lm_head_logits, rms_norm, token_logprobs
from titan_rl.kernels.attention.reference import attention_reference
from titan_rl.kernels.attention.torch_impl import kv_cache_write
BLOCK = 32  # a KV page granule of vLLM's CPU cache; the shapes below cross it
from titan_rl.kernels.lm_head.reference import token_logprobs_reference
from titan_rl.kernels.matmul.reference import linear_reference
from titan_rl.kernels.rmsnorm.reference import rms_norm_reference

DTYPES = [torch.float32, torch.bfloat16]
# Tolerances vs references: fp32 accumulations of K terms ~ sqrt(K)*eps relative;
# bf16 outputs are rounded to 8 mantissa bits (eps 2^-8).
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_reference_and_is_row_invariant(dtype, rng):
    K, N = 384, 200
    w = torch.randn(N, K, generator=rng).to(dtype)
    x = torch.randn(150, K, generator=rng).to(dtype)
    full = linear(x, w)
    torch.testing.assert_close(full.float(), linear_reference(x.double(), w.double()).float(),
                               rtol=TOL[dtype], atol=TOL[dtype] * math.sqrt(K))
    for m in (1, 2, 3, 17, 64, 65, 149):
        assert torch.equal(linear(x[:m], w), full[:m]), m
        assert torch.equal(linear(x[-m:], w), full[-m:]), m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(77, 301), (1003, 576), (16, 1537), (5, 64)])
def test_the_trainers_plain_weight_gives_the_engines_bits(n, k, dtype, rng):
    """The trainer's per-call weight (fp32 where the chain kernel gives oneDNN's bits at this K:
    every call on its packed copy, csrc/f32_chain.cpp; else oneDNN on the weight as it lies,
    reordered inside the call) and the engine's, reordered once per load: every row count, odd
    ones included, gives the same bits either way, at 1 and 2 threads."""
    from tests._threads import threads
    from titan_rl.kernels.matmul import torch_impl as mm

    w = torch.randn(n, k, generator=rng).to(dtype)
    x = torch.randn(257, k, generator=rng).to(dtype)
    plain, reordered = mm.PackedWeight(w, reorder=False), mm.PackedWeight(w)
    assert not reordered.all_rows
    # the trainer's fp32 form is the chain kernel wherever its AVX-512 form is built (it must then
    # match oneDNN at these K, or this fails)
    assert plain.all_rows == (dtype == torch.float32 and mm._few_rows_form(torch.float32))
    if mm.GEMM == "onednn" and not plain.all_rows:  # the two really are different operands
        assert (plain.data.shape, plain.data.stride()) != (reordered.data.shape, reordered.data.stride())
    for t in (1, 2):
        with threads(t):
            for m in (1, 3, 8, 13, 64, 130, 257):
                want = linear(x[:m], reordered)
                assert torch.equal(linear(x[:m], plain), want), (t, m)
                assert torch.equal(linear(x[:m], w), want), (t, m)  # what the trainer's linear builds


@pytest.mark.parametrize("n,k", [(77, 301), (33, 7), (997, 1537), (16, 2), (1, 1)])
def test_packed_weights_are_the_layouts_the_kernels_read(n, k, rng):
    """bf16_logits_pack: [ceil(N/32), ceil(K/2), 32, 2]; few_rows_f32_pack: [ceil(N/16), K, 16];
    zeros past N and K (a copy: no arithmetic), at 1 and 2 threads."""
    import torch.nn.functional as F
    from tests._threads import threads
    from titan_rl.kernels.cpu_ext import ops

    w = torch.randn(n, k, generator=rng)
    nb, kp, nb16 = -(-n // 32), -(-k // 2), -(-n // 16)
    want = F.pad(w.bfloat16(), (0, 2 * kp - k, 0, nb * 32 - n)).view(nb, 32, kp, 2).permute(0, 2, 1, 3)
    want32 = F.pad(w, (0, 0, 0, nb16 * 16 - n)).view(nb16, 16, k).permute(0, 2, 1)
    for t in (1, 2):
        with threads(t):
            assert torch.equal(ops().bf16_logits_pack(w.bfloat16()), want)
            assert torch.equal(ops().few_rows_f32_pack(w), want32)


def _few_rows_or_skip(dtype):
    from titan_rl.kernels.matmul import torch_impl as mm

    if not mm._few_rows_form(dtype):
        pytest.skip(f"no few-rows kernel for {dtype} here (bf16: no native bf16 GEMM; fp32: no AVX-512 build; "
                    "or masked): the engine pads as the trainer does")
    return mm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [300, 512, 514, 700, 1024, 1026, 1100, 3001, 4098])
def test_onednns_gemm_sums_k_in_the_chunks_the_few_rows_path_uses(k, dtype):
    """oneDNN's GEMM (the trainer's and the engine's at 8+ rows) read off its outputs
    (matmul.torch_impl.boundary_probe): a chunk starts exactly at each multiple of
    onednn_k_chunk(k) below K (none for K <= 512), whatever N, in bf16 and fp32; the few-rows
    path adds its chunks there. A one-term tail cannot show and rounds the same either way."""
    mm = _few_rows_or_skip(dtype)
    x = mm.boundary_probe(k, dtype)
    chunk = mm.onednn_k_chunk(k)
    want = [s for s in range(32, k, 32) if chunk and s % chunk == 0 and k - s >= 2]
    for n in (16, 77, 300):
        y = linear(x, torch.ones(n, k, dtype=dtype)).float()
        assert float(y.min()) == (1024.0 if dtype == torch.bfloat16 else 1.0)
        if dtype == torch.bfloat16:  # 1024 or 1032 (fp32: above 1 by the tail's terms, which vary in count)
            assert len(set(y.unique().tolist())) <= 2
        assert bool((y == y[:, :1]).all())
        assert [32 * (r + 1) for r in range(x.shape[0]) if y[r, 0] != y.min()] == want, n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(997, 301), (77, 1537), (512, 512), (9, 33), (130, 777), (40, 2050)])
def test_few_rows_on_the_engine_copy_are_onednns_bits(n, k, dtype, rng):
    """Decode at 1-4 rows (FEW_ROWS) reads the engine weight's few-rows copy instead of padding
    to oneDNN's 8 rows: each row == the padded call's row (the trainer's path), at 1 and 2
    threads, wherever the rows sit in the batch; and == the reference's chains over oneDNN's K
    chunks, added in order (bf16: vdpbf16ps, rounded to bf16; fp32: FMAs, on bf16-valued
    operands so that the fp64 reference is exact). N crosses the kernels' block groups and
    tails; K odd and past one and two chunks."""
    from tests._threads import threads
    from titan_rl.kernels.matmul.reference import dpbf16_dot

    mm = _few_rows_or_skip(dtype)
    chunk = mm.onednn_k_chunk(k) or k
    for exact_ref in (True, False) if dtype == torch.float32 else (True,):
        w = (torch.randn(n, k, generator=rng) * k**-0.5).to(torch.bfloat16 if exact_ref else dtype).to(dtype)
        x = torch.randn(13, k, generator=rng).to(torch.bfloat16 if exact_ref else dtype).to(dtype)
        engine, trainer = mm.gemm_weight(w), mm.PackedWeight(w)
        assert engine.few_rows is not None and trainer.few_rows is None
        full = linear(x, trainer)
        if exact_ref:
            ref = None
            for c0 in range(0, k, chunk):
                xs, ws = x[:, c0:c0 + chunk], w[:, c0:c0 + chunk]
                part = dpbf16_dot(xs, ws) if dtype == torch.bfloat16 else _fma_chain(xs.t(), ws.t())
                ref = part if ref is None else ref + part
            assert torch.equal(full, ref.to(dtype))
            # the trainer's per-call weight: fp32 on the chain kernel at every row count
            assert torch.equal(linear(x, mm.PackedWeight(w, reorder=False)), ref.to(dtype))
        for t in (1, 2):
            with threads(t):
                for r in range(1, mm.FEW_ROWS + 1):
                    for s in (0, 5, 13 - r):
                        assert torch.equal(linear(x[s:s + r], engine), full[s:s + r]), (t, r, s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference_and_is_row_invariant(dtype, rng):
    x = torch.randn(70, 96, generator=rng).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=rng)).to(dtype)
    full = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(full, rms_norm_reference(x, w, 1e-6), rtol=TOL[dtype], atol=TOL[dtype])
    for m in (1, 2, 5, 69):
        assert torch.equal(rms_norm(x[:m], w, 1e-6), full[:m])
    # heads view (q/k norm): same rows, different leading shape
    assert torch.equal(rms_norm(x.view(10, 7, 96), w, 1e-6).view(70, 96), full)


def test_lm_head_fp32_matches_reference_and_is_row_invariant(rng):
    h = torch.randn(33, 64, generator=rng).to(torch.bfloat16)
    w = (0.05 * torch.randn(500, 64, generator=rng)).to(torch.bfloat16)
    tok = torch.randint(0, 500, (33,), generator=rng)
    logits = lm_head_logits(h, w.float())
    assert logits.dtype == torch.float32
    lp = token_logprobs(logits, tok)
    torch.testing.assert_close(lp.double(), token_logprobs_reference(h, w, tok), rtol=0, atol=1e-5)
    for m in (1, 4, 32):
        assert torch.equal(token_logprobs(lm_head_logits(h[:m], w.float()), tok[:m]), lp[:m])


def _dpbf16_form():
    from titan_rl.kernels.lm_head import torch_impl as head

    if head.HEAD_FORM != "dpbf16":
        pytest.skip("this build has neither AVX512-BF16 nor AVX2 + FMA: the bf16 LM head runs the fp32 form")
    return head


@pytest.mark.parametrize("scale", [1.0, 2.0**-63, 2.0**-126])
def test_lm_head_dpbf16_is_the_instructions_bits(scale, rng):
    """Whichever instructions compute it here (vdpbf16ps, or FMAs under DAZ/FTZ on AVX2:
    csrc/dpbf16_avx2.h), the bf16 head's logits are the dpbf16 reference's bits: per k-pair
    the odd product then the even one, fused adds, subnormals flushed. Odd sizes, several row
    counts, and operands whose products and sums fall in the subnormal range (where a
    non-fused or unflushed form would differ)."""
    from titan_rl.kernels.matmul.reference import dpbf16_dot

    _dpbf16_form()
    h = (torch.randn(13, 37, generator=rng) * scale).to(torch.bfloat16)
    w = torch.randn(43, 37, generator=rng).to(torch.bfloat16)
    if scale != 1.0:
        w = (w.float() * 2.0**-60 / scale**0.5 if scale < 2.0**-100 else w.float() * scale).to(torch.bfloat16)
    ref = dpbf16_dot(h, w)
    for m in (1, 4, 13):
        got = lm_head_logits(h[:m], w)
        assert torch.equal(got.view(torch.int32), ref[:m].view(torch.int32)), m
    if scale != 1.0:  # the case exercises the flush: the plain fp32 sum of products differs
        assert not torch.equal((h.float() @ w.float().t()).view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("k,n", [(203, 997), (64, 77), (512, 1000)])
def test_lm_head_dpbf16_is_row_layout_thread_invariant(k, n, rng, monkeypatch):
    """The bf16 LM head (csrc/bf16_logits.cpp): fp32 logits within fp32 rounding of the fp64
    products (tolerance: K terms of |h w| ~ 1, fp32 eps 2^-24, times sqrt(K)); every row's
    bits alone == in any batch, at 1 and 2 threads, engine-prepared == trainer; its
    gradients are the FMA chains of the upcast operands (the weight gradient the fp32 head's,
    bit for bit; the input gradient one chain over the vocabulary, each row alone == batched)."""
    from tests._threads import threads

    head = _dpbf16_form()
    h = torch.randn(69, k, generator=rng).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=rng) * k**-0.5).to(torch.bfloat16)
    full = lm_head_logits(h, w)
    assert full.dtype == torch.float32 and full.shape == (69, n)
    ref = h.double() @ w.double().t()
    assert (full.double() - ref).abs().max().item() < 2**-24 * k**0.5 * 8
    prepared = head.lm_head_weight(w)
    assert isinstance(prepared, head.PackedHead)
    assert torch.equal(lm_head_logits(h, prepared), full)
    for m in (1, 2, 5, 6, 7, 13, 68):
        assert torch.equal(lm_head_logits(h[:m], w), full[:m]), m
        assert torch.equal(lm_head_logits(h[-m:], prepared), full[-m:]), m
    with threads(1):
        one = lm_head_logits(h, w)
    with threads(2):
        two = lm_head_logits(h, w)
    assert torch.equal(one, full) and torch.equal(two, full)
    # backward, on the upcast operands (a linear loss: the same upstream gradient for both forms)
    # (g bf16-valued: then the fp64 emulation of the chain is exact, _fma_chain)
    grads, g = {}, torch.randn(69, n, generator=rng).bfloat16().float()
    for form in ("dpbf16", "fp32"):
        monkeypatch.setattr(head, "HEAD_FORM", form)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        (lm_head_logits(hh, ww) * g).sum().backward()
        grads[form] = (hh.grad, ww.grad)
    assert torch.equal(grads["dpbf16"][1], grads["fp32"][1])  # the weight gradient: the same chain
    # the input gradient g @ W: per output the fp32 FMA chain over the vocabulary, in order
    assert torch.equal(grads["dpbf16"][0], _fma_chain(g.t(), w.float()).to(torch.bfloat16))
    for m in (1, 7):  # a row's input gradient alone == in the batch
        hh = h[-m:].clone().requires_grad_()
        monkeypatch.setattr(head, "HEAD_FORM", "dpbf16")
        (lm_head_logits(hh, w) * g[-m:]).sum().backward()
        assert torch.equal(hh.grad, grads["dpbf16"][0][-m:]), m
    # and within fp32 rounding of the fp32 head's (oneDNN's order): relative to the largest entry
    d = (grads["dpbf16"][0].float() - grads["fp32"][0].float()).abs().max() / grads["fp32"][0].float().abs().max()
    assert d.item() < 2**-7, d.item()  # both rounded to bf16 at the end: a bf16 ulp at most


def test_lm_head_dpbf16_refuses_fp32_hidden(rng):
    head = _dpbf16_form()
    w = torch.randn(40, 16, generator=rng).to(torch.bfloat16)
    with pytest.raises(TypeError, match="takes bf16 hidden states"):
        lm_head_logits(torch.randn(3, 16, generator=rng), head.lm_head_weight(w))


def _qkv(rng, B, L, H, Hkv, D, dtype):
    q = torch.randn(B, L, H, D, generator=rng).to(dtype)
    k = torch.randn(B, L, Hkv, D, generator=rng).to(dtype)
    v = torch.randn(B, L, Hkv, D, generator=rng).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_dense_matches_reference(dtype, rng):
    q, k, v = _qkv(rng, 2, 75, 4, 2, 32, dtype)
    out = attention_dense(q, k, v, 32**-0.5)
    torch.testing.assert_close(out.float(), attention_reference(q, k, v, 32**-0.5).float(),
                               rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_dense_batch_and_length_invariant(dtype, rng):
    q, k, v = _qkv(rng, 3, 70, 4, 2, 32, dtype)
    full = attention_dense(q, k, v, 0.2)
    # one sequence alone, and a prefix of it (fewer KV blocks visited)
    assert torch.equal(attention_dense(q[1:2], k[1:2], v[1:2], 0.2), full[1:2])
    assert torch.equal(attention_dense(q[:, :33], k[:, :33], v[:, :33], 0.2), full[:, :33])


def _paged_cache(k, v, page, n_pages, perm):
    """Write sequences [S, L, Hkv, D] into a shuffled paged cache [n_pages, Hkv, 2, page, D]
    whose unused slots hold NaN (like uninitialised memory); returns cache, block table."""
    S, L, Hkv, D = k.shape
    kv = torch.full((n_pages, Hkv, 2, page, D), float("nan"), dtype=k.dtype)
    per_seq = -(-L // page)
    table = perm[: S * per_seq].reshape(S, per_seq)
    pos = torch.arange(L)
    for s in range(S):
        kv_cache_write(kv, k[s], v[s], table[s, pos // page] * page + pos % page)
    return kv, table


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_paged_equals_dense_for_every_split(dtype, rng):
    """Prefill chunks and decodes over a paged cache (NaN in unused slots) give the bits
    of the trainer's dense causal attention, row for row."""
    S, L, H, Hkv, D, page = 3, 2 * BLOCK + 7, 4, 2, 32, 2 * BLOCK
    q, k, v = _qkv(rng, S, L, H, Hkv, D, dtype)
    dense = attention_dense(q, k, v, 0.25)
    n_pages = 16
    kv, table = _paged_cache(k, v, page, n_pages, torch.randperm(n_pages, generator=rng))
    # a step where seq 0 decodes at every position, seq 1 prefills a chunk, seq 2 whole prefill
    for t in [0, 1, BLOCK - 1, BLOCK, L - 1]:
        chunk0 = (t, t + 1)
        chunk1 = (max(0, t - 5), t + 1)
        chunk2 = (0, t + 1)
        spans = [chunk0, chunk1, chunk2]
        qs = torch.cat([q[s, a:b] for s, (a, b) in enumerate(spans)])
        qsl = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0)
        seq_lens = torch.tensor([b for _, b in spans])
        out = attention_paged(qs, kv, qsl, seq_lens, table, 0.25)
        for s, (a, b) in enumerate(spans):
            got = out[qsl[s] : qsl[s + 1]]
            assert torch.equal(got, dense[s, a:b]), (t, s)


def test_attention_paged_random_layouts(rng):
    """Random head layouts, page sizes, batch compositions and prefill/decode spans:
    every row equals the trainer's dense attention bitwise. Head sizes up to 256, odd multiples
    of 16 among them (the bf16 form groups 4, 2 or 1 rows by head size)."""
    import random

    r = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    for _ in range(12):
        D, Hkv, G = r.choice([32, 48, 64, 80, 128, 256]), r.choice([1, 2, 4]), r.choice([1, 2, 3, 4])
        dtype, page = r.choice(DTYPES), r.choice([32, 64, 128])
        S = r.randint(1, 5)
        lens = [r.randint(1, 140) for _ in range(S)]
        q, k, v = _qkv(rng, S, max(lens), Hkv * G, Hkv, D, dtype)
        dense = attention_dense(q, k, v, D**-0.5)
        n_pages = S * (-(-max(lens) // page)) + 2
        kv, table = _paged_cache(k, v, page, n_pages, torch.randperm(n_pages, generator=rng))
        spans = []
        for s in range(S):
            a = r.randint(0, lens[s] - 1)
            spans.append((a, r.randint(a + 1, lens[s])))
        qs = torch.cat([q[s, a:b] for s, (a, b) in enumerate(spans)])
        qsl = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0)
        out = attention_paged(qs, kv, qsl, torch.tensor([b for _, b in spans]), table, D**-0.5)
        for s, (a, b) in enumerate(spans):
            assert torch.equal(out[qsl[s] : qsl[s + 1]], dense[s, a:b]), (D, Hkv, G, dtype, page, lens, spans)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_skips_padding_slots(dtype, rng):
    """vLLM marks padding tokens with slot -1: the write stores every other token where its
    slot says and touches nothing for those (the engine passes its slots unfiltered)."""
    page, hkv, D = 32, 2, 64
    k = torch.randn(7, hkv, D, generator=rng).to(dtype)
    v = torch.randn(7, hkv, D, generator=rng).to(dtype)
    slots = torch.tensor([5, -1, 40, 3, -1, 63, 0])
    keep = slots >= 0
    cache = torch.full((3, hkv, 2, page, D), 7.0, dtype=dtype)
    ref = cache.clone()
    kv_cache_write(ref, k[keep], v[keep], slots[keep])
    kv_cache_write(cache, k, v, slots)
    assert torch.equal(cache, ref)
    assert int((ref != 7.0).sum()) > 0


def test_linear_backward_is_the_gradient(rng):
    """The invariant forward's backward uses plain GEMMs: same gradient up to fp32 rounding."""
    x = torch.randn(70, 48, generator=rng, requires_grad=True)
    w = torch.randn(30, 48, generator=rng, requires_grad=True)
    g = torch.randn(70, 30, generator=rng)
    (linear(x, w) * g).sum().backward()
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (linear_reference(x2, w2) * g.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w2.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(linear(x, w), linear(x.detach(), w.detach()))


def _fma_chain(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum over rows m in order of fma(g[m, n], x[m, k], acc) from +0, in fp64 rounded to fp32
    after each step: the correctly rounded FMA wherever acc + product is exact in fp64, which
    holds for bf16-valued operands within a few binades (at most 24 + 16 + 16 bits apart)."""
    acc = torch.zeros(g.shape[1], x.shape[1], dtype=torch.float64)
    for m in range(g.shape[0]):
        acc = (acc + g[m].double()[:, None] * x[m].double()[None, :]).float().double()
    return acc.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_gemm_is_one_fma_chain_per_output(dtype, rng):
    """The weight gradient (kernels/csrc/weight_grad.cpp) is, for every output, the fp32 FMA
    chain over the rows in order from +0: equal to that definition, so its bits cannot depend on
    the tile an output falls in, the thread count, which slice of N or K a call holds (a TP
    rank's block) or the vector width the CPU has. Odd shapes crossing the 128-row chunks,
    1024-column blocks and groups of 16 tiles (192 or 96 output rows, which each thread packs and
    fetches ahead together); strided (column-block) views of both operands."""
    from tests._threads import threads
    from titan_rl.kernels.cpu_ext import ops as _ops
    from titan_rl.kernels.matmul.reference import weight_grad_bf16
    from titan_rl.kernels.matmul.torch_impl import grad_weight

    for m, n, k in [(1, 1, 1), (0, 3, 4), (5, 13, 3), (130, 25, 45), (257, 7, 1030), (300, 131, 33),
                    (260, 413, 45)]:
        g = (torch.randn(m, n + 5, generator=rng) * 2).bfloat16().to(dtype)
        x = (torch.randn(m, k + 2, generator=rng) * 2).bfloat16().to(dtype)
        want = (_fma_chain(g[:, 5:], x[:, :k]) if dtype == torch.float32 else
                weight_grad_bf16(g[:, 5:], x[:, :k])).to(dtype)
        got = grad_weight(g[:, 5:], x[:, :k])
        assert got.dtype == dtype and torch.equal(got, want), (m, n, k, dtype)
        if n > 2 and k > 2:
            assert torch.equal(grad_weight(g[:, 5 + n // 2:].contiguous(), x[:, k // 3:k].contiguous()),
                               want[n // 2:, k // 3:])
        for t in (1, 2):
            with threads(t):
                assert torch.equal(grad_weight(g[:, 5:], x[:, :k]), want), (m, n, k, dtype, t)
        # mixed operands (the bf16 LM head's backward: fp32 grad, bf16 weight), widened exactly
        other = torch.bfloat16 if dtype == torch.float32 else torch.float32
        mixed = _ops().weight_grad(g[:, 5:], x[:, :k].to(other))
        assert torch.equal(mixed, _fma_chain(g[:, 5:], x[:, :k])), (m, n, k, other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_gradient_is_one_fma_chain_per_output(dtype, rng):
    """The input gradient grad @ W (bf16: the weight gradient's GEMM on grad read transposed;
    fp32: csrc/f32_chain.cpp on W's column blocks) is for every output the fp32 FMA chain over N
    in order from +0, so a row's bits do not depend on the rows beside it (batch invariance, the
    property a linear's backward must keep), the thread count or the CPU kind. Odd shapes (401
    rows: three groups of tiles; K not a multiple of 16; N past 4096, where the fp32 chain runs
    in passes), prefixes of the rows, 1 and 2 threads."""
    from tests._threads import threads
    from titan_rl.kernels.matmul.reference import weight_grad_bf16
    from titan_rl.kernels.matmul.torch_impl import grad_input

    for m, n, k in [(1, 1, 1), (7, 13, 3), (130, 333, 45), (33, 1030, 70), (401, 150, 37), (9, 5001, 21)]:
        grad = (torch.randn(m, n, generator=rng) * 2).bfloat16().to(dtype)
        w = (torch.randn(n, k, generator=rng) * 2).bfloat16().to(dtype)
        want = (_fma_chain(grad.t(), w) if dtype == torch.float32 else weight_grad_bf16(grad.t(), w)).to(dtype)
        got = grad_input(grad, w)
        assert got.dtype == dtype and torch.equal(got, want), (m, n, k)
        for rows in {1, m // 2 + 1, m}:
            assert torch.equal(grad_input(grad[-rows:].contiguous(), w), want[-rows:]), (m, n, k, rows)
        for t in (1, 2):
            with threads(t):
                assert torch.equal(grad_input(grad, w), want), (m, n, k, t)


def test_the_flush_decides_tininess_after_rounding():
    """An exact sum in [2^-126 - 2^-150, 2^-126 - 2^-151): rounded with an unbounded exponent it
    is 2^-126 - 2^-150, below the smallest normal, and FTZ flushes it to 0 (vdpbf16ps, and the
    FMAs under MXCSR's flags on AVX2); rounding into fp32's subnormal grid first would give
    2^-126. Here 2^-126 (the odd, first-added product 2^-63 x 2^-63) plus -3 x 2^-152 (the even
    one): the reference, the bf16 weight and input gradients and the bf16 LM head all give 0,
    and a sum just outside the window (-2^-152) stays 2^-126."""
    from titan_rl.kernels.matmul.reference import dpbf16_dot, weight_grad_bf16
    from titan_rl.kernels.matmul.torch_impl import grad_input, grad_weight

    for even, want in ((-3 * 2.0**-76, 0.0), (-(2.0**-76), 2.0**-126)):
        # one output, K = 2: index 1 is the pair's odd (first-added) slot
        a = torch.tensor([[even, 2.0**-63]]).bfloat16()
        w = torch.tensor([[2.0**-76, 2.0**-63]]).bfloat16()
        assert dpbf16_dot(a, w).item() == want
        # the gradients' chains run over rows: row 0 is the first-added one (swapped pairs)
        g, x = a.t().flip(0).contiguous(), w.t().flip(0).contiguous()  # rows: [2^-63, even], [2^-63, 2^-76]
        assert weight_grad_bf16(g, x).item() == want
        assert grad_weight(g, x).float().item() == want
        assert grad_input(g.t().contiguous(), x).float().item() == want
        _dpbf16_form()
        assert lm_head_logits(a, w).item() == want


@pytest.mark.parametrize("scale", [2.0**-63, 2.0**-64])
def test_bf16_gradient_gemms_flush_subnormals_as_vdpbf16ps_does(scale, rng):
    """Both operands bf16: the FMA chain under DAZ / FTZ over an even row count
    (reference.weight_grad_bf16), which is what vdpbf16ps computes on row pairs (AVX512-BF16
    CPUs) and what the FMAs compute under MXCSR's flags elsewhere: one set of bits on every CPU
    kind. Operands whose products and partial sums fall in fp32's subnormal range, where the
    unflushed chain differs (asserted, so the case exercises the flush); odd row counts (the
    zero row that makes them even), both gradients, 1 and 2 threads."""
    from tests._threads import threads
    from titan_rl.kernels.matmul.reference import weight_grad_bf16
    from titan_rl.kernels.matmul.torch_impl import grad_input, grad_weight

    for m, n, k in [(1, 3, 5), (77, 19, 35), (129, 30, 41), (257, 13, 33)]:
        g = (torch.randn(m, n, generator=rng) * scale).bfloat16()
        x = (torch.randn(m, k, generator=rng) * scale).bfloat16()
        want = weight_grad_bf16(g, x)
        for t in (1, 2):
            with threads(t):
                assert torch.equal(grad_weight(g, x).view(torch.int16), want.bfloat16().view(torch.int16)), (m, t)
                # grad x^T [k, m] @ weight g [m, n]: the chain over m again, on the transposed view
                assert torch.equal(grad_input(x.t().contiguous(), g).view(torch.int16),
                                   weight_grad_bf16(x, g).bfloat16().view(torch.int16)), (m, t)
        if m > 1:
            assert not torch.equal(want.view(torch.int32), _fma_chain(g, x).view(torch.int32))


def test_weight_gradient_gemm_is_close_to_fp64(rng):
    """At real magnitudes (fp32 operands of 2048 rows) the FMA chain is an fp32 sum: within a
    few ulps of the fp64 product relative to the largest output (measured 2e-6 at 2048 x 3072 x
    512 against oneDNN's)."""
    from titan_rl.kernels.matmul.torch_impl import grad_weight

    g, x = torch.randn(2048, 67, generator=rng), torch.randn(2048, 50, generator=rng)
    ref = g.double().t() @ x.double()
    assert ((grad_weight(g, x).double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_attention_backward_is_the_gradient(rng):
    q, k, v = (t.requires_grad_() for t in _qkv(rng, 2, 40, 4, 2, 32, torch.float32))
    g = torch.randn(2, 40, 4, 32, generator=rng)
    (attention_dense(q, k, v, 0.2) * g).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    (attention_reference(*ref, 0.2).double() * g.double()).sum().backward()
    for a, b in zip((q, k, v), ref):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(attention_dense(q, k, v, 0.2), attention_dense(q.detach(), k.detach(), v.detach(), 0.2))


# -- compiled elementwise / row-wise ops: reference closeness, invariance, gradients -----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [7, 200, 1536])
def test_silu_mul_matches_reference_and_is_row_invariant(width, dtype, rng):
    from titan_rl.kernels.elementwise import silu_mul
    from titan_rl.kernels.elementwise.reference import silu_mul_reference

    g, u = (3 * torch.randn(70, width, generator=rng)).to(dtype), torch.randn(70, width, generator=rng).to(dtype)
    full = silu_mul(g, u)
    # fp32: the polynomial exp is within ~2 ulp, so silu * up within a few 1e-7 relative
    # (1e-5 allowed); bf16 rounds twice (silu, then the product, as torch does): within
    # one bf16 ulp (2^-7 relative) of the once-rounded reference, 2e-2 allowed.
    tol = 1e-5 if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(full.double(), silu_mul_reference(g, u).double(), rtol=tol, atol=tol)
    for m in (1, 2, 3, 17, 69):
        assert torch.equal(silu_mul(g[:m], u[:m]), full[:m]), m
    g2, u2 = g.detach().float().requires_grad_(), u.detach().float().requires_grad_()
    silu_mul(g2, u2).sum().backward()
    g3, u3 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    (torch.nn.functional.silu(g3) * u3).sum().backward()
    torch.testing.assert_close(g2.grad.double(), g3.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(u2.grad.double(), u3.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [7, 201])
def test_silu_mul_on_the_halves_of_one_gemm_output_reads_and_writes_in_place(width, dtype, rng):
    """gate and up as the two halves of one [M, 2I] output (Ops.same_input's split_last):
    the same bits as separate tensors, forward and backward, at 1 and 2 threads; the
    backward writes d_gate and d_up as the halves of one buffer, which split_last's
    backward passes on as the output's gradient (the same tensor, no concatenation)."""
    from tests._threads import threads
    from titan_rl.kernels.autograd import _joined, split_last
    from titan_rl.kernels.cpu_ext import ops
    from titan_rl.kernels.elementwise import silu_mul

    y = (3 * torch.randn(37, 2 * width, generator=rng)).to(dtype)
    w = torch.randn(37, width, generator=rng).to(dtype)

    def fused():
        yy = y.clone().requires_grad_()
        gate, up = split_last(yy, [width, width])
        out = silu_mul(gate, up)
        (out.float() * w.float()).sum().backward()
        return out.detach(), yy.grad

    def separate():
        gg, uu = y[:, :width].clone().requires_grad_(), y[:, width:].clone().requires_grad_()
        out = silu_mul(gg, uu)
        (out.float() * w.float()).sum().backward()
        return out.detach(), torch.cat([gg.grad, uu.grad], -1)

    want = separate()
    for n in (1, 2):
        with threads(n):
            got = fused()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), n
    dg, du = ops().silu_mul_backward(w, y[:, :width], y[:, width:])
    assert dg._base is du._base and _joined((dg, du), [width, width]) is dg._base
    apart = ops().silu_mul_backward(w, y[:, :width].contiguous(), y[:, width:].contiguous())
    assert apart[0]._base is None and torch.equal(_joined(apart, [width, width]), dg._base)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [36, 200, 328])
def test_silu_mul_gradient_is_the_same_on_a_tp_ranks_half_of_the_columns(width, dtype, rng):
    """A TP rank computes silu(gate) * up on its half of the columns (and on any number of
    rows): each element's gradient must be the unsharded call's bits."""
    from titan_rl.kernels.elementwise import silu_mul

    g, u, w = (torch.randn(37, width, generator=rng).to(dtype) for _ in range(3))

    def grads(cols, rows):
        gg, uu = g[rows, cols].clone().requires_grad_(), u[rows, cols].clone().requires_grad_()
        (silu_mul(gg, uu).float() * w[rows, cols].float()).sum().backward()
        return gg.grad, uu.grad

    full = grads(slice(None), slice(None))
    h = width // 2
    for cols in (slice(0, h), slice(h, None)):
        for rows in (slice(None), slice(0, 5), slice(3, 29)):
            part = grads(cols, rows)
            for a, b in zip(part, full):
                assert torch.equal(a, b[rows, cols]), (cols, rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_reference_and_its_gradient(dtype, rng):
    from titan_rl.kernels.elementwise import rope
    from titan_rl.kernels.elementwise.reference import rope_error_bound, rope_reference

    x = torch.randn(50, 3, 64, generator=rng).to(dtype)
    pos = torch.randint(0, 5000, (50,), generator=rng)
    # The reference takes HF's fp32 angles (at pos 5000 they are off the real ones by up
    # to 3e-4 rad: part of the definition); what remains is the kernel's rounding of
    # cos/sin, products and sum, bounded per element for any input (rope_error_bound).
    err = (rope(x, pos, 1e6).double() - rope_reference(x, pos, 1e6).double()).abs()
    assert bool((err <= rope_error_bound(x, dtype)).all()), float((err / rope_error_bound(x, dtype)).max())
    # the gradient is the transposed rotation of w by the same cos/sin: the same bound, in w
    xg = x.detach().float().requires_grad_()
    w = torch.randn(50, 3, 64, generator=rng)
    (rope(xg, pos, 1e6) * w).sum().backward()
    xr = x.detach().double().requires_grad_()
    (rope_reference(xr, pos, 1e6) * w.double()).sum().backward()
    assert bool(((xg.grad.double() - xr.grad).abs() <= rope_error_bound(w, torch.float32)).all())
    # the compiled backward (the rotation with -sin) is the eager transposed rotation's bits:
    # g*c + [g2*s, -(g1*s)], each product and the sum rounded to the dtype
    from titan_rl.kernels.elementwise.torch_impl import rope_cos_sin

    for d, T in [(64, 50), (34, 7), (98, 1)]:  # head widths off the multiples of 16 too
        p = torch.randint(0, 3000, (T,), generator=rng)
        for dt in (torch.float32, torch.bfloat16):
            xx = torch.randn(T, 3, d, generator=rng).to(dt).requires_grad_()
            g = torch.randn(T, 3, d, generator=rng).to(dt)
            rope(xx, p, 1e6).backward(g)
            c, s = rope_cos_sin(p, d, 1e6, dt)
            gs = g * s
            assert torch.equal(xx.grad, g * c + torch.cat([gs[..., d // 2:], -gs[..., : d // 2]], -1)), (d, dt)


def _rms_grads(x, w, g):
    xx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (rms_norm(xx, ww, 1e-6).float() * g.float()).sum().backward()
    return xx.grad, ww.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [77, 200, 333])
def test_rms_norm_backward_is_close_to_fp64_and_invariant(width, dtype, rng):
    """The compiled backward (csrc/rowwise.cpp rms_norm_backward). Closeness to the fp64
    gradient of the same function: fp32 within 1e-5 of the largest entry (fp32 sums of
    `width` terms); bf16 within 2e-2 (the forward rounds the normalised row to bf16, which
    the fp64 reference does not, and the gradients are rounded to bf16). Invariance, bitwise:
    a row's input gradient alone == in any batch; both gradients at 1 == 2 threads; the
    weight gradient's per-head partial depends on that head's rows only (a TP rank holding
    some heads gets the unsharded call's partials)."""
    from tests._threads import threads
    from titan_rl.kernels.cpu_ext import ops
    from titan_rl.kernels.rmsnorm.torch_impl import rms_norm_eager

    x = (3 * torch.randn(69, width, generator=rng)).to(dtype)
    w = (1 + 0.1 * torch.randn(width, generator=rng)).to(dtype)
    g = torch.randn(69, width, generator=rng).to(dtype)
    gx, gw = _rms_grads(x, w, g)
    assert gx.dtype == dtype and gw.dtype == dtype
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    (rms_norm_eager(x64, w64, 1e-6) * g.double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, ref in ((gx, x64.grad), (gw, w64.grad)):
        assert (got.double() - ref).abs().max() <= tol * ref.abs().max(), (got.double() - ref).abs().max()
    for rows in (slice(0, 1), slice(0, 5), slice(3, 40), slice(68, 69)):
        assert torch.equal(_rms_grads(x[rows], w, g[rows])[0], gx[rows]), rows
    with threads(1):
        one = _rms_grads(x, w, g)
    with threads(2):
        two = _rms_grads(x, w, g)
    assert all(torch.equal(a, b) for a, b in zip(one, (gx, gw))) and all(torch.equal(a, b) for a, b in zip(two, one))
    x3, g3 = x[:69].view(23, 3, width), g[:69].view(23, 3, width)
    _, parts = ops().rms_norm_backward(g3, x3, w, 1e-6, 3)
    for h in range(3):
        _, alone = ops().rms_norm_backward(g3[:, h].contiguous(), x3[:, h].contiguous(), w, 1e-6, 1)
        assert torch.equal(parts[h], alone[0]), h
    assert torch.equal(ops().rms_norm_backward(g, x, w, 1e-6, 1)[1][0].to(dtype), gw)