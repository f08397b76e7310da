"""The compiled attention kernel (kernels/csrc/paged_attention.cpp) that the trainer's
dense forward and the engine's paged prefill/decode both call.

Invariance (torch.equal): a row computed alone (a one-token decode of its sequence)
equals the same row inside batches of 1..64 sequences mixing prefill chunks and
decodes, for every prefill/decode split, random chunked prefills, prefix-cache hits
(shared pages), shuffled pages with NaN in unused slots, head_dim 64/128/256, GQA
ratios 1/2/4/8, fp32 and bf16, torch threads 1 and 2.

Closeness to the fp64 reference: the output is a convex combination of value rows
(|o| <= max |v| ~ 4 for randn inputs); fp32 arithmetic over <= 300 positions stays
within 1e-5 absolute (measured ~6e-7); bf16 outputs are rounded to 8 mantissa bits
(2^-8 relative of |o| <= 4: 1.6e-2), so 2e-2 absolute. The bf16 dpbf16 and amx forms also
round the softmax weights to bf16 (2^-9 relative each; measured max error 8.8e-3 against the
fp32 form's 7.8e-3 at L = 300), inside the same bound. The amx form is also held bit for bit
to its arithmetic written out (reference.attention_amx_form).
"""

import ctypes
import ctypes.util
import random

import pytest
import torch

from titan_rl.kernels import attention_dense, attention_paged
from titan_rl.kernels.attention import torch_impl
from titan_rl.kernels.attention.reference import attention_amx_form, attention_reference
from titan_rl.kernels.attention.torch_impl import kv_cache_write

DTYPES = [torch.float32, torch.bfloat16]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LAYOUTS = [(64, 1), (64, 2), (128, 4), (256, 8), (128, 1), (80, 2)]  # (head_dim, GQA ratio)
# bf16's forms (torch_impl.ATTN_FORM): every test runs each form this CPU has
FORMS = (["fp32"] + (["dpbf16"] if torch_impl._dpbf16_available() else [])
         + (["amx"] if torch_impl._amx_available() else []))


@pytest.fixture(autouse=True, params=FORMS)
def attn_form(request, monkeypatch):
    monkeypatch.setattr(torch_impl, "ATTN_FORM", request.param)
    return request.param


def _seqs(rng, lens, hkv, g, d, dtype):
    """Per sequence q [L, H, D], k/v [L, Hkv, D]."""
    return [(torch.randn(n, hkv * g, d, generator=rng).to(dtype), torch.randn(n, hkv, d, generator=rng).to(dtype),
             torch.randn(n, hkv, d, generator=rng).to(dtype)) for n in lens]


class _Cache:
    """A shuffled paged cache in vLLM's CPU layout [pages, Hkv, 2, page, D], NaN in every
    slot never written (uninitialised memory)."""

    def __init__(self, rng, seqs, page, share_prefix=None):
        hkv, d, dtype = seqs[0][1].shape[1], seqs[0][1].shape[2], seqs[0][1].dtype
        need = [-(-s[1].shape[0] // page) for s in seqs]
        n_pages = sum(need) + 3
        perm = torch.randperm(n_pages, generator=rng).tolist()
        self.kv = torch.full((n_pages, hkv, 2, page, d), float("nan"), dtype=dtype)
        self.table = torch.zeros(len(seqs), max(need), dtype=torch.int32)
        for s, (_, k, v) in enumerate(seqs):
            for p in range(need[s]):
                if share_prefix and s in share_prefix and p < share_prefix[s][1]:
                    self.table[s, p] = self.table[share_prefix[s][0], p]  # a prefix-cache hit: same page
                    continue
                self.table[s, p] = perm.pop()
            pos = torch.arange(k.shape[0])
            kv_cache_write(self.kv, k, v, self.table[s, pos // page].long() * page + pos % page)

    def run(self, seqs, spans, rows=None):
        """Queries of positions [a, b) of each sequence (KV up to b) in one call."""
        sel = range(len(seqs)) if rows is None else rows
        qs = torch.cat([seqs[s][0][a:b] for s, (a, b) in zip(sel, spans)])
        qsl = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0).to(torch.int32)
        out = attention_paged(qs, self.kv, qsl, torch.tensor([b for _, b in spans], dtype=torch.int32),
                              self.table[list(sel)], seqs[0][0].shape[-1] ** -0.5)
        return [out[qsl[i]:qsl[i + 1]] for i in range(len(spans))]


def _alone(cache, seqs, s, t):
    """Row t of sequence s computed as a one-token decode, nothing else in the call."""
    return cache.run(seqs, [(t, t + 1)], rows=[s])[0][0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,G", LAYOUTS)
def test_dense_matches_reference(D, G, dtype, rng):
    q, k, v = (torch.randn(2, 75, h, D, generator=rng).to(dtype) for h in (2 * G, 2, 2))
    got = attention_dense(q, k, v, D**-0.5)
    ref = attention_reference(q.double(), k.double(), v.double(), D**-0.5)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=ATOL[dtype])


@pytest.mark.parametrize("L,D,G", [(37, 80, 3), (301, 64, 2), (33, 48, 1), (19, 128, 4)])
def test_the_amx_form_computes_its_written_out_arithmetic(L, D, G, attn_form, rng):
    """torch.equal against kernels/attention/reference.py's attention_amx_form, which spells out
    the form's sums (tdpbf16ps's even / odd chains per 32 dims of the scores and per 16
    positions of the values, exp_f, the lane sums), at odd lengths and head sizes whose last
    score chunk is short (80, 48): the bf16 output and the fp32 log-sum-exp (max + logf(sum),
    libm's logf as the kernel calls it). The dpbf16 form sums the scores in another order: its
    log-sum-exps differ, so the check can fail."""
    if attn_form == "fp32":
        pytest.skip("the reference is of the bf16 pair-layout forms' amx arithmetic")
    q, k, v = (torch.randn(L, h, D, generator=rng).bfloat16() for h in (2 * G, 2, 2))
    got, lse = torch_impl._dense_forward(q[None], k[None], v[None], D**-0.5, with_lse=True)
    out, rmax, rsum = attention_amx_form(q, k, v, D**-0.5)
    logf = ctypes.CDLL(ctypes.util.find_library("m")).logf
    logf.restype, logf.argtypes = ctypes.c_float, [ctypes.c_float]
    want_lse = rmax + torch.tensor([logf(x) for x in rsum.flatten().tolist()], dtype=torch.float32).view_as(rsum)
    if attn_form == "amx":
        assert torch.equal(got[0], out) and torch.equal(lse[0], want_lse)
    else:
        assert not torch.equal(lse[0], want_lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,G", LAYOUTS)
def test_row_alone_equals_row_in_batches_of_1_to_64(D, G, dtype, at_1_and_2_threads, rng):
    r = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    lens = [r.randint(1, 40) for _ in range(64)]
    seqs = _seqs(rng, lens, 2, G, D, dtype)
    cache = _Cache(rng, seqs, page=32)
    probe = [(s, r.randrange(lens[s])) for s in range(64)]
    alone = {(s, t): _alone(cache, seqs, s, t) for s, t in probe}
    for n in (1, 2, 3, 7, 16, 33, 64):
        spans = []
        for s in range(n):  # decodes, chunks and whole prefills, ending at the probed position + more
            t = probe[s][1]
            a = r.choice([t, r.randint(0, t), 0])
            spans.append((a, r.randint(t + 1, lens[s])))
        outs = cache.run(seqs[:n], spans, rows=list(range(n)))
        for s in range(n):
            t, (a, _) = probe[s][1], spans[s]
            assert torch.equal(outs[s][t - a], alone[(s, t)]), (n, s, t, spans[s])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,G", [(64, 2), (128, 8)])
def test_every_prefill_decode_split_equals_dense(D, G, dtype, at_1_and_2_threads, rng):
    L = 37
    seqs = _seqs(rng, [L], 2, G, D, dtype)
    q, k, v = seqs[0]
    dense = attention_dense(q[None], k[None], v[None], D**-0.5)[0]
    cache = _Cache(rng, seqs, page=32)
    for c in range(1, L + 1):  # prefill [0, c), then decodes c .. L-1
        rows = cache.run(seqs, [(0, c)])[0]
        rows = torch.cat([rows] + [cache.run(seqs, [(t, t + 1)])[0] for t in range(c, L)])
        assert torch.equal(rows, dense), c


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_and_prefix_cache_hits_equal_dense(dtype, at_1_and_2_threads, rng):
    r = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    D, G, page = 128, 4, 32
    lens = [150, 150, 97]
    seqs = _seqs(rng, lens, 2, G, D, dtype)
    # sequence 1 shares sequence 0's first 64 positions (2 pages) as a prefix-cache hit
    seqs[1] = tuple(torch.cat([a[:64], b[64:]]) for a, b in zip(seqs[0], seqs[1]))
    cache = _Cache(rng, seqs, page, share_prefix={1: (0, 2)})
    dense = [attention_dense(q[None], k[None], v[None], D**-0.5)[0] for q, k, v in seqs]
    for s, n in enumerate(lens):
        cuts = sorted(set([0, n] + [r.randint(1, n - 1) for _ in range(4)]))
        if s == 1:  # the hit: the engine computes only the positions after the cached prefix
            cuts = [c for c in cuts if c >= 64] or [n]
            cuts = [64] + [c for c in cuts if c > 64]
        for a, b in zip(cuts, cuts[1:]):
            assert torch.equal(cache.run(seqs, [(a, b)], rows=[s])[0], dense[s][a:b]), (s, a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_uninitialised_slots_never_read(rng, dtype):
    """A cache full of NaN outside the written slots gives finite rows (odd lengths: the
    bf16 form's unpaired last position)."""
    seqs = _seqs(rng, [5, 71], 2, 2, 64, dtype)
    out = _Cache(rng, seqs, page=64).run(seqs, [(0, 5), (0, 71)])
    assert all(torch.isfinite(o).all() for o in out)
