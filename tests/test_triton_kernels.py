"""Triton kernels (kernels/*/triton_impl.py) under TRITON_INTERPRET=1 on CPU tensors:
closeness to the reference (stated tolerance) and batch invariance (torch.equal); the
model end to end on the dispatcher's Triton column (trainer dense forward == paged
prefill + decode); vLLM's CUDA backend's metadata -> kernel arguments.

The interpreter is 100-1000x slower than torch, so shapes are tiny but still cross
every tile edge (rows > one row tile, K and N not multiples of the blocks, several KV
blocks, several vocab chunks). Its bf16 tl.dot is broken, so GEMM-based ops run in fp32
here; RMSNorm (no tl.dot) also runs in bf16.

TRITON_INTERPRET must be set before triton is first imported (triton.language's own
@jit helpers such as tl.sum are decorated at that import, and so is every triton_impl module
another test file imports later). So this module runs in-process only when the variable
was set from the start (`TRITON_INTERPRET=1 pytest tests/test_triton_kernels.py`);
otherwise every test here is skipped and test_in_a_fresh_interpreter_process runs this file
in a child process with the variable set.
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

import math  # noqa: E402

import pytest  # noqa: E402

from _interpreter_harness import harness, restore  # noqa: E402

pytest.importorskip("numpy")
pytest.importorskip("triton")

import torch  # noqa: E402

from titan_rl.kernels.attention import triton_impl as attn  # noqa: E402
from titan_rl.kernels.attention.reference import attention_reference  # noqa: E402
from titan_rl.kernels.lm_head import triton_impl as lm  # noqa: E402
from titan_rl.kernels.lm_head.reference import token_logprobs_reference  # noqa: E402
from titan_rl.kernels.matmul import triton_impl as mm  # noqa: E402
from titan_rl.kernels.matmul.reference import linear_reference  # noqa: E402
from titan_rl.kernels.rmsnorm import triton_impl as rn  # noqa: E402
from titan_rl.kernels.rmsnorm.reference import rms_norm_reference  # noqa: E402

if IN_PROCESS:
    # @triton.jit picks interpreter vs compiler when a kernel is decorated (at import): if
    # these modules were imported before the variable was set, re-decorate them.
    mm, rn, attn = (importlib.reload(m) for m in (mm, rn, attn))
    lm = importlib.reload(lm)  # after mm: it binds mm.linear
    from titan_rl.kernels.interpreter import pin_interpreter_dot

    pin_interpreter_dot()  # tl.dot without the host BLAS's row-position dependence


restore(_PREV)  # set only while this module imports (above) and runs (_interpreter_env)
_interpreter_env, _in_process_only, test_in_a_fresh_interpreter_process = harness(_PREV, IN_PROCESS, __file__)


BLOCK = attn.BLOCK
# fp32: accumulations of K terms ~ sqrt(K)*eps relative; bf16 outputs carry 8 mantissa bits.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def test_linear_matches_reference_and_is_row_invariant(rng):
    # K=96: three K steps with a masked tail; N=70: two column tiles; 150 rows: three row tiles.
    M, K, N = 150, 96, 70
    x = torch.randn(M, K, generator=rng)
    w = torch.randn(N, K, generator=rng)
    full = mm.linear(x, w)
    torch.testing.assert_close(full.double(), linear_reference(x.double(), w.double()),
                               rtol=1e-4, atol=1e-4 * math.sqrt(K))
    for m in (1, 2, 17, 64, 65, 149):
        assert torch.equal(mm.linear(x[:m], w), full[:m]), m
        assert torch.equal(mm.linear(x[-m:], w), full[-m:]), m
    for i in (0, 63, 64, 100, 149):  # a row alone sits at tile position 0
        assert torch.equal(mm.linear(x[i : i + 1], w), full[i : i + 1]), i
    assert torch.equal(mm.linear(x.view(10, 15, K), w).view(M, N), full)  # leading dims


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference_and_is_row_invariant(dtype, rng):
    x = torch.randn(40, 96, generator=rng).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=rng)).to(dtype)
    full = rn.rms_norm(x, w, 1e-6)
    assert full.dtype == dtype
    torch.testing.assert_close(full, rms_norm_reference(x, w, 1e-6), rtol=TOL[dtype], atol=TOL[dtype])
    for m in (1, 2, 5, 39):
        assert torch.equal(rn.rms_norm(x[:m], w, 1e-6), full[:m]), m
        assert torch.equal(rn.rms_norm(x[-m:], w, 1e-6), full[-m:]), m
    assert torch.equal(rn.rms_norm(x.view(8, 5, 96), w, 1e-6).view(40, 96), full)  # q/k-norm view


def test_lm_head_fp32_matches_reference_and_is_row_invariant(rng):
    # V=2500: three vocab chunks of BLOCK_V=1024 with a masked tail.
    h = torch.randn(20, 64, generator=rng)
    w = 0.05 * torch.randn(2500, 64, generator=rng)
    tok = torch.randint(0, 2500, (20,), generator=rng)
    logits = lm.lm_head_logits(h, w)
    assert logits.dtype == torch.float32
    lp = lm.token_logprobs(logits, tok)
    torch.testing.assert_close(lp.double(), token_logprobs_reference(h, w, tok), rtol=0, atol=1e-5)
    lsm = lm.log_softmax_fp32(logits)
    torch.testing.assert_close(lsm, logits.double().log_softmax(-1).float(), rtol=0, atol=1e-5)
    for m in (1, 3, 19):
        assert torch.equal(lm.token_logprobs(lm.lm_head_logits(h[:m], w), tok[:m]), lp[:m]), m
        assert torch.equal(lm.log_softmax_fp32(logits[-m:]), lsm[-m:]), m


def test_log_softmax_handles_masked_vocab(rng):
    """-inf logits (a banned vocab prefix longer than a chunk) give -inf, never NaN."""
    x = torch.randn(3, 2100, generator=rng)
    x[:, :1500] = float("-inf")
    y = lm.log_softmax_fp32(x)
    assert torch.equal(torch.isinf(y), torch.isinf(x)) and not torch.isnan(y).any()
    torch.testing.assert_close(y[:, 1500:], x[:, 1500:].log_softmax(-1), rtol=0, atol=1e-5)


def _qkv(rng, B, L, H, Hkv, D):
    return (torch.randn(B, L, H, D, generator=rng), torch.randn(B, L, Hkv, D, generator=rng),
            torch.randn(B, L, Hkv, D, generator=rng))


def test_attention_dense_matches_reference_and_is_batch_and_length_invariant(rng):
    q, k, v = _qkv(rng, 3, 2 * BLOCK + 6, 4, 2, 32)  # GQA 2:1, three KV blocks, ragged last
    full = attn.attention_dense(q, k, v, 0.2)
    torch.testing.assert_close(full.double(), attention_reference(q, k, v, 0.2).double(), rtol=1e-4, atol=1e-4)
    assert torch.equal(attn.attention_dense(q[1:2], k[1:2], v[1:2], 0.2), full[1:2])  # alone
    for L in (1, BLOCK, BLOCK + 1):  # prefix: fewer KV blocks visited
        assert torch.equal(attn.attention_dense(q[:, :L], k[:, :L], v[:, :L], 0.2), full[:, :L]), L


def _paged_cache(k, v, page, n_pages, perm):
    """Write sequences [S, L, Hkv, D] into a shuffled paged cache [n_pages, Hkv, 2, page, D]
    (keys, values), NaN in unused slots; returns cache, block table."""
    S, L, Hkv, D = k.shape
    kv = torch.full((n_pages, Hkv, 2, page, D), float("nan"))
    table = perm[: S * -(-L // page)].view(S, -1)
    for s in range(S):
        for t in range(L):
            kv[table[s, t // page], :, 0, t % page] = k[s, t]
            kv[table[s, t // page], :, 1, t % page] = v[s, t]
    return kv, table


def test_attention_paged_equals_dense_for_every_split(rng):
    """Decode, chunked prefill and whole prefill over a paged NaN-filled cache give the
    bits of the Triton dense (trainer) attention, row for row."""
    S, L, H, Hkv, D, page = 3, BLOCK + 7, 4, 2, 16, 2 * BLOCK
    q, k, v = _qkv(rng, S, L, H, Hkv, D)
    dense = attn.attention_dense(q, k, v, 0.25)
    kv, table = _paged_cache(k, v, page, 8, torch.randperm(8, generator=rng))
    for t in (0, BLOCK - 1, BLOCK, L - 1):
        spans = [(t, t + 1), (max(0, t - 5), t + 1), (0, t + 1)]
        qs = torch.cat([q[s, a:b] for s, (a, b) in enumerate(spans)])
        qsl = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0)
        seq_lens = torch.tensor([b for _, b in spans])
        out = attn.attention_paged(qs, kv, qsl, seq_lens, table, 0.25)
        for s, (a, b) in enumerate(spans):
            assert torch.equal(out[qsl[s] : qsl[s + 1]], dense[s, a:b]), (t, s)


# -- the model end to end on the dispatcher's Triton column (kernels/dispatch.py) -------------

def _tiny_model(seed):
    from titan_rl.models import qwen3

    cfg = qwen3.Qwen3Config(vocab_size=130, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return qwen3.Qwen3ForCausalLM(cfg).init_weights(seed)


def test_model_trainer_dense_equals_paged_decode_on_triton(rng, monkeypatch):
    """Every op of the trainer's dense forward and of a paged prefill + decode (mixed
    chunk lengths, shuffled NaN-filled pages) runs the Triton kernels: logits torch.equal.
    The contract and the self-check name the Triton kernels."""
    from titan_rl import contract
    from titan_rl.kernels import dispatch, log_softmax_fp32, selfcheck
    from titan_rl.paged_decode import paged_logits

    m = _tiny_model(int(torch.randint(0, 2**31, (1,), generator=rng)))
    tokens = torch.randint(0, 130, (2, 9), generator=rng)
    with dispatch.use_backend("triton"):
        with torch.no_grad():
            dense = m(tokens)
        paged = paged_logits(m, tokens, prefill=3)
        assert torch.equal(dense, paged)
        assert torch.equal(log_softmax_fp32(dense), log_softmax_fp32(paged))
        # the probe itself takes minutes under the interpreter; gpu_check.py runs it on a GPU
        monkeypatch.setattr(contract, "check_platform", lambda *a, **k: None)
        e = contract.contract_of(m).entries()
        assert e["op.linear"] == "titan_rl.kernels.matmul.triton_impl.linear"
        assert e["op.attention"] == "titan_rl.kernels.attention.triton_impl"
        assert e["op.rope"] == "titan_rl.kernels.elementwise.triton_impl.rope"
        assert e["platform.backend"] == "triton" and e["selfcheck"] == "passed"
        probed = selfcheck._default_ops("cpu")
        assert all(".triton_impl" in fn.__module__ for fn in probed.values())
        # the trainer's backward runs through the Triton forwards
        log_softmax_fp32(m(tokens[:1, :5])).mean().backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


# -- elementwise, MoE: reference and a row alone vs in batches (odd sizes) ----------------

def _rows_invariant(fn, x, *rest, sizes=(1, 2, 5)):
    full = fn(x, *rest)
    for m in sizes:
        assert torch.equal(fn(x[:m], *(r[:m] for r in rest)), full[:m]), m
        assert torch.equal(fn(x[-m:], *(r[-m:] for r in rest)), full[-m:]), m
    return full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_rope_match_reference_and_are_row_invariant(dtype, rng):
    from titan_rl.kernels.elementwise import triton_impl as ew
    from titan_rl.kernels.elementwise.reference import rope_error_bound, rope_reference, silu_mul_reference

    g, u = (3 * torch.randn(11, 200, generator=rng)).to(dtype), torch.randn(11, 200, generator=rng).to(dtype)
    y = _rows_invariant(ew.silu_mul, g, u)
    torch.testing.assert_close(y, silu_mul_reference(g, u), rtol=TOL[dtype], atol=TOL[dtype])
    x = torch.randn(9, 3, 32, generator=rng).to(dtype)
    pos = torch.randint(0, 3000, (9,), generator=rng)
    y = _rows_invariant(lambda a, p: ew.rope(a, p, 1e6), x, pos)
    # HF's fp32 angles on both sides; the kernel's roundings are bounded per element (any seed)
    err = (y.double() - rope_reference(x, pos, 1e6).double()).abs()
    assert bool((err <= rope_error_bound(x, dtype)).all()), float((err / rope_error_bound(x, dtype)).max())


def test_moe_router_and_combine_match_reference_and_are_row_invariant(rng):
    from titan_rl.kernels.moe import triton_impl as tm
    from titan_rl.kernels.moe.reference import moe_experts_reference, router_topk_reference

    T, H, E, k, inter = 13, 40, 7, 3, 24
    x = torch.randn(T, H, generator=rng)
    gate = torch.randn(E, H, generator=rng) / H**0.5
    gate[3] = gate[5]  # a tie: the lower expert index first
    w_gate, w_up, w_down = (torch.randn(E, inter, H, generator=rng) / H**0.5, torch.randn(E, inter, H, generator=rng)
                            / H**0.5, torch.randn(E, H, inter, generator=rng) / inter**0.5)
    w, ids = tm.router_topk(x, gate, k, True)
    rw, rids = router_topk_reference(x, gate, k, True)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    assert all(list(r).index(3) < list(r).index(5) for r in ids.tolist() if 3 in r and 5 in r)
    for m in (1, 4, T - 1):
        wm, im = tm.router_topk(x[-m:], gate, k, True)
        assert torch.equal(wm, w[-m:]) and torch.equal(im, ids[-m:]), m
    from titan_rl.kernels.elementwise import triton_impl as ew

    experts = [lambda xe, e=e: mm.linear(ew.silu_mul(mm.linear(xe, w_gate[e]), mm.linear(xe, w_up[e])), w_down[e])
               for e in range(E)]
    out = tm.moe_experts(x, ids, w, experts)
    torch.testing.assert_close(out, moe_experts_reference(x, ids, w, w_gate, w_up, w_down), rtol=1e-4, atol=1e-4)
    for m in (1, 2, 6):
        assert torch.equal(tm.moe_experts(x[:m], ids[:m], w[:m], experts), out[:m]), m


def test_top_k_top_p_drop_mask_matches_torch_impl_and_is_row_invariant(rng):
    """No sort: bisection over the values' order. Top-k counts are exact, so it equals
    torch_impl's mask; top-p may differ only where torch's sorted cumsum lies within
    rounding of 1 - p. Ties (by token id), -inf entries and disabled rows included."""
    from titan_rl.kernels.sampling import torch_impl as ts
    from titan_rl.kernels.sampling import triton_impl as tsp

    N, V = 7, 1100  # two vocab chunks, the second ragged
    x = 3 * torch.randn(N, V, generator=rng)
    x[1, 100:400] = x[1, 50]  # a long tie
    x[2, :900] = float("-inf")
    k = torch.tensor([5, 0, 37, V, 1, 300, 12])
    p = torch.tensor([0.9, 0.5, 1.0, 0.3, 0.95, 0.7, 1.0])
    got_k = tsp.drop_mask(x, k, None)
    assert torch.equal(got_k, ts.drop_mask(x, k, None))
    got = tsp.drop_mask(x, k, p)
    want = ts.drop_mask(x, k, p)
    differ = (got != want).nonzero()
    if differ.numel():  # only at the top-p boundary, within fp32 rounding
        xs = x.masked_fill(got_k, float("-inf"))
        vals, idx = xs.sort(-1, stable=True)
        cum = vals.softmax(-1).cumsum(-1)
        rank = torch.empty_like(idx).scatter_(1, idx, torch.arange(V).expand(N, V))
        for r, v in differ.tolist():
            assert abs(float(cum[r, rank[r, v]]) - (1 - float(p[r]))) < 1e-5, (r, v)
    assert not got[:, :].all(-1).any()  # something is always kept
    for m in (1, 3):
        assert torch.equal(tsp.drop_mask(x[-m:], k[-m:], p[-m:]), got[-m:]), m
    assert torch.equal(tsp.drop_mask(x[3:4], k[3:4], p[3:4]), got[3:4])


# -- the tensor-parallel pieces (kernels/matmul/blocks.py over this form's GEMMs) -----------

def test_tree_sum_gives_the_torch_forms_bits(rng):
    """One IEEE add per element and level, in the same tree: torch.equal to torch_impl's at odd
    element counts (more than one pair block), and a count not a power of two refused. fp32
    only here: the interpreter's fp32 -> bf16 cast truncates (measured: 5 of 15 sums one ulp
    off torch's round-to-nearest), where the GPU rounds to nearest even as torch does."""
    from titan_rl.kernels.matmul import torch_impl as cpu_mm

    for n, shape in ((1, (7,)), (2, (3, 5)), (4, (1031,)), (8, (13, 11))):
        parts = torch.randn(n, *shape, generator=rng)
        assert torch.equal(mm.tree_sum(parts), cpu_mm.tree_sum(parts)), (n, shape)
    with pytest.raises(ValueError, match="power-of-two"):
        mm.tree_sum(torch.zeros(3, 4))


def test_tp_pieces_equal_the_ranks_and_match_the_reference(seed, rng):
    """The Triton forms' K-leaves, column blocks (forward and fixed-shape backward) and the
    per-head norm's weight gradient: one call equals TP "ranks" finished by the same tree
    (tests/_tp_pieces.py, fp32: the interpreter's bf16 tl.dot is broken; the head norm has
    no dot and runs in bf16 too); the leaves' sum stays within fp32 rounding of the reference."""
    import _tp_pieces

    _tp_pieces.k_leaves_equal_the_ranks_subtrees(mm.linear_k_leaves, mm.leaf_partials, mm.tree_sum, torch.float32,
                                                 seed)
    _tp_pieces.column_blocks_backward_equals_the_ranks_subtrees(mm.linear_n_blocks, mm.tree_sum, torch.float32, seed)
    for dtype in (torch.float32, torch.bfloat16):
        _tp_pieces.head_norm_weight_gradient_equals_the_ranks_heads(rn.rms_norm_heads, rn.rms_norm, dtype, seed)
    x, w = torch.randn(37, 72, generator=rng), torch.randn(80, 72, generator=rng)
    torch.testing.assert_close(mm.linear_k_leaves(x, w, 8).double(), linear_reference(x.double(), w.double()),
                               rtol=1e-4, atol=1e-4 * math.sqrt(72))
    torch.testing.assert_close(mm.linear_n_blocks(x, w, 8).double(), linear_reference(x.double(), w.double()),
                               rtol=1e-4, atol=1e-4 * math.sqrt(72))


def test_vllm_cuda_backend_metadata_to_kernel_arguments(rng):
    """titan_rl/vllm/attention_cuda.py on CPU: vLLM's GPU cache layout [blocks, Hkv, block,
    2*D] with HND strides as a view the kernel reads, the Triton backend's metadata as the
    kernel's arguments: a mixed decode / chunk / prefill step equals the dense rows."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionCGSupport

    import titan_rl.kernels as K
    from titan_rl.vllm import attention_cuda as ac

    assert ac.TitanTritonAttentionBackend.get_builder_cls()._cudagraph_support == AttentionCGSupport.NEVER
    assert ac.TitanTritonAttentionBackend.get_impl_cls().kernel is K.attention_paged
    S, L, H, Hkv, D, page, n_blocks = 3, 21, 4, 2, 32, 16, 7
    q, k, v = _qkv(rng, S, L, H, Hkv, D)
    dense = attn.attention_dense(q, k, v, 0.3)
    raw = torch.full((n_blocks, page, Hkv, 2 * D), float("nan")).permute(0, 2, 1, 3)  # HND strides
    view = ac.cache_view(raw, D)
    assert view.data_ptr() == raw.data_ptr() and view.shape == (n_blocks, Hkv, 2, page, D)
    table = torch.randperm(n_blocks, generator=rng)[: S * 2].view(S, 2).to(torch.int32)
    pos = torch.arange(L)
    for s in range(S):
        attn.kv_cache_write(view, k[s], v[s], table[s, pos // page].long() * page + pos % page)
    spans = [(L - 1, L), (L - 6, L), (0, L)]
    qs = torch.cat([q[s, a:b] for s, (a, b) in enumerate(spans)])
    qsl = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0).to(torch.int32)
    md = SimpleNamespace(num_actual_tokens=qs.shape[0], query_start_loc=qsl, block_table=table,
                         seq_lens=torch.tensor([b for _, b in spans], dtype=torch.int32), max_query_len=L)
    padded = torch.cat([qs, torch.zeros(3, H, D)])  # vLLM pads the step; rows past num_actual_tokens
    out = attn.attention_paged(**ac.kernel_args(padded, raw, md, D, 0.3))
    for s, (a, b) in enumerate(spans):
        assert torch.equal(out[qsl[s]: qsl[s + 1]], dense[s, a:b]), s
