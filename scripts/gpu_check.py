"""The GPU path, checked in one run: Triton kernel invariance, model parity, speed.

    python scripts/gpu_check.py [--json OUT]                                  # on a CUDA GPU
    TRITON_INTERPRET=1 python scripts/gpu_check.py --cpu-interpret [--json OUT]  # on CPU

(a) invariance: each Triton kernel (kernels/*/triton_impl.py, as the dispatcher picks them: all of its ops)
    on batches of 1..N rows (N = 1024 on the GPU; sequences for attention and GDN): every
    row of every batch, a row alone included, equals the same row of the largest batch,
    torch.equal. The known traps: the linear at K = 512, 1024, 2048, 4096 (where vLLM's
    batch-invariant GEMM was reported to break) and odd K; fp32 linear, LM head and
    attention against fp64 (relative error < 1e-5: a TF32 dot lands near 3e-4).
(a') the compiler: every Triton kernel compiled for sm_90 (H200) in a child process without
    the interpreter, its PTX free of TF32 instructions (the TF32 trap as the compiler shows
    it: an fp32 tl.dot without input_precision="ieee"; the interpreter computes it exactly,
    so on CPU only this row can fail). Skipped, not passed, without a CUDA backend.
(b) parity: every registered architecture (qwen3, llama, qwen3_moe, the four GDN hybrids,
    GLM-5) at its debug flavor, bf16 and fp32 on the GPU, scored by the trainer's dense
    forward vs a paged prefill + decode through the same kernels
    (titan_rl/paged_decode.py: KV pages, carried recurrent states, GLM-5's latent pages):
    logits torch.equal and max |dlogp| = 0. On the GPU the platform self-check
    (kernels/selfcheck.py) runs too.
(c) speed (GPU only), as ratios (ours / reference, same shapes, median of CUDA-event
    timings): the linear vs cuBLAS (F.linear) at decode and prefill shapes, attention vs
    SDPA (FlashAttention), a small-flavor decode step (paged, our kernels) vs the stock
    model (F.linear, SDPA over dense K/V), a small-flavor trainer forward+backward vs the
    stock model.
(d) recipes: fp8_rowwise, fp8_block, mxfp8, nvfp4, nvfp4_w4a4 on the qwen3 debug flavor,
    trainer dense forward vs paged decode, logits torch.equal (the dense form: fake-quantized
    operands through the Triton linear). Needs torchao, which the GPU image lacks: carry its
    wheel (README.md of the device tool: `pip download --no-deps torchao==0.18.0` for
    python 3.12), else (d) is reported skipped.
--cpu-interpret runs (a), (a'), (b) and (d) at tiny shapes in fp32 under the Triton interpreter.

How long: sized for one 10-minute device window, not yet measured on a GPU (the one lent on
2026-12-04 was withdrawn before the first call). The interpreter form, all of it, took 303 s
on a quiet 2-core AMD EPYC (2026-12-04): (a) 88 s, (a') 2 s with Triton's cache warm,
(b) 161 s, (d) 52 s.
What it prints: one line per check (ok / FAILED), one per speed row (ours ms, reference ms,
ratio), any exception a check raised (the check fails, the run goes on), and a progress
line per section; the JSON is rewritten after each section, so a run cut short keeps
what it measured.

Only torch and triton are needed (no vLLM, TorchTitan or torchao: the GPU image has none):
when titan_rl is not installed, the repository's folders are mapped onto it. The JSON's
"checks" are booleans; exits 1 unless all are true.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_titan_rl() -> None:
    """Make `titan_rl.kernels` / `titan_rl.models` importable from a bare checkout, with
    titan_rl's console filters on before torch and torchao load (titan_rl.quiet)."""
    try:
        import titan_rl  # noqa: F401  (light: imports nothing of torch's)
    except ImportError:
        sys.path.insert(0, str(ROOT))
    from titan_rl import quiet

    quiet.install()
    try:
        import titan_rl.kernels  # noqa: F401
    except ImportError:
        import titan_rl

        titan_rl.__path__.append(str(ROOT))  # titan_rl.kernels -> kernels/, titan_rl.models -> models/


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--cpu-interpret", action="store_true", help="(a), (b), (d) on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)  # the child of (a')
    return ap.parse_args()


class Sizes:
    """The shapes of one run: the GPU's, or tiny ones for the interpreter."""

    def __init__(self, interpret: bool):
        self.interpret = interpret
        self.rows = 24 if interpret else 1024
        self.batches = (1, 2, 3, 5, 8, 13, 17, 24) if interpret else tuple(range(1, 1025))
        self.seqs = 5 if interpret else 64
        self.seq_batches = tuple(range(1, self.seqs + 1))
        self.K, self.N = (40, 70) if interpret else (1000, 1100)  # not multiples of the tiles
        self.hidden = 72 if interpret else 1000
        self.vocab = 1100 if interpret else 16411
        self.heads, self.kv_heads, self.head_dim = (4, 2, 32) if interpret else (16, 8, 128)
        self.seq_len = 37 if interpret else 200
        self.dtype = "float32" if interpret else "bfloat16"
        # the K trap: batch-invariant GEMMs reported to break at K a power of two in 512..4096
        # (vLLM's batch-invariant mode); odd K beside them
        self.trap_ks = (512, 1024, 2048, 4096, 1000, 1531)
        self.trap_n = 70 if interpret else 1100
        self.trap_batches = (1, 3, 17, 24) if interpret else (1, 2, 3, 7, 16, 17, 63, 64, 65, 255, 1000, 1024)
        # parity: every registered architecture, (batch, seq_len), dtypes
        self.parity_shape = (2, 7) if interpret else (8, 96)
        self.parity_dtypes = ("float32",) if interpret else ("bfloat16", "float32")


# -- (a) invariance -------------------------------------------------------------------------

TRAP_ERRORS: dict[str, float] = {}  # the TF32 trap's relative errors, for the JSON
ERRORS: dict[str, str] = {}  # check -> the exception it raised (the check fails, the run goes on)


def _guarded(name: str, fn, failed=False, cast=bool):
    """fn() as cast, or `failed` with the exception kept in ERRORS: one broken op must not
    cost the rest of a short GPU window."""
    try:
        return cast(fn())
    except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
        import traceback

        ERRORS[name] = f"{type(e).__name__}: {e}"[:600]
        traceback.print_exc()
        return failed


def _rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def _rows(out, n):
    return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]


def _row_check(fn, n_rows, batches) -> bool:
    """fn(b) computes the first b rows; every batch must reproduce the largest's rows."""
    full = fn(n_rows)
    return all(_equal(fn(b), _rows(full, b)) for b in batches if b <= n_rows)


def invariance(sz: Sizes, dev, dtype) -> dict[str, bool]:
    import torch

    from titan_rl.kernels.attention import triton_impl as at
    from titan_rl.kernels.attention.reference import attention_reference
    from titan_rl.kernels.elementwise import triton_impl as ew
    from titan_rl.kernels.gdn import l2norm, lane_stable
    from titan_rl.kernels.gdn import triton_impl as gd
    from titan_rl.kernels.lm_head import triton_impl as lm
    from titan_rl.kernels.matmul import triton_impl as mm
    from titan_rl.kernels.moe import triton_impl as mo
    from titan_rl.kernels.rmsnorm import triton_impl as rn
    from titan_rl.kernels.sampling import triton_impl as sp

    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0, dt=None):
        return (scale * torch.randn(*shape, generator=g)).to(device=dev, dtype=dt or dtype)

    R, K, N, Hd, V = sz.rows, sz.K, sz.N, sz.hidden, sz.vocab
    H, Hkv, D = sz.heads, sz.kv_heads, sz.head_dim
    f32 = torch.float32
    x, w = randn(R, K), randn(N, K, scale=K**-0.5)
    h, nw = randn(R, Hd), 1 + randn(Hd, scale=0.1)
    gate, up = randn(R, Hd, scale=3.0), randn(R, Hd)
    xr, pos = randn(R, 3, D), torch.randint(0, 4096, (R,), generator=g).to(dev)
    hf, wl = randn(R, 256, dt=f32), randn(V, 256, scale=256**-0.5, dt=f32)
    logits = randn(R, V, scale=4.0, dt=f32)
    tok = torch.randint(0, V, (R,), generator=g).to(dev)
    E, k = 9, 3
    wg = randn(E, Hd, scale=Hd**-0.5)
    w_e = [randn(Hd, Hd, scale=Hd**-0.5) for _ in range(E)]
    experts = [lambda t, e=e: mm.linear(t, w_e[e]) for e in range(E)]
    ids_w = mo.router_topk(h, wg, k, True)
    top_k = torch.randint(0, 60, (R,), generator=g).to(dev)
    top_p = (0.5 + 0.5 * torch.rand(R, generator=g)).to(dev)
    checks: dict[str, bool] = {}
    from titan_rl.kernels.indexer import triton_impl as ix
    from titan_rl.kernels.layernorm import triton_impl as ln
    from titan_rl.kernels.sparse_attention import triton_impl as sa

    def check(name, fn):
        checks[name] = _guarded(name, fn)

    check("linear", lambda: _row_check(lambda b: mm.linear(x[:b], w), R, sz.batches))
    check("rms_norm", lambda: _row_check(lambda b: rn.rms_norm(h[:b], nw, 1e-6), R, sz.batches))
    check("silu_mul", lambda: _row_check(lambda b: ew.silu_mul(gate[:b], up[:b]), R, sz.batches))
    check("rope", lambda: _row_check(lambda b: ew.rope(xr[:b], pos[:b], 1e6), R, sz.batches))
    check("lm_head_logits", lambda: _row_check(lambda b: lm.lm_head_logits(hf[:b], wl), R, sz.batches))
    check("log_softmax_fp32", lambda: _row_check(lambda b: lm.log_softmax_fp32(logits[:b]), R, sz.batches))
    check("token_logprobs", lambda: _row_check(lambda b: lm.token_logprobs(logits[:b], tok[:b]), R, sz.batches))
    check("router_topk", lambda: _row_check(lambda b: mo.router_topk(h[:b], wg, k, True), R, sz.batches))
    check("moe_experts", lambda: _row_check(lambda b: mo.moe_experts(h[:b], ids_w[1][:b], ids_w[0][:b], experts), R,
                                            sz.batches))
    check("drop_mask", lambda: _row_check(lambda b: sp.drop_mask(logits[:b], top_k[:b], top_p[:b]), R, sz.batches))
    # GLM-5: LayerNorm, the sigmoid router with group limits, the indexer's top-k and the
    # sparse attention over a paged latent cache (query rows of several sequences)
    lb = randn(Hd, scale=0.1)
    check("layer_norm", lambda: _row_check(lambda b: ln.layer_norm(h[:b], nw, lb, 1e-6), R, sz.batches))
    sig_bias = randn(16, scale=0.1, dt=f32)

    def stable_sigmoid(z):  # the model's row-stable elementwise form
        return lane_stable(torch.sigmoid, z)

    wg16 = randn(16, Hd, scale=Hd**-0.5)
    check("router_sigmoid_topk", lambda: _row_check(
        lambda b: mo.router_sigmoid_topk(h[:b], wg16, sig_bias, 4, 4, 2, True, 2.5, sigmoid=stable_sigmoid)[:2], R,
        sz.batches))

    def heads_norm():  # rows invariant; the weight gradient's tree over heads and rows the same bits twice
        hw = (xr.new_ones(D, dtype=f32) + randn(D, scale=0.01, dt=f32)).to(dtype)
        up = randn(*xr.shape)
        grads = []
        for _ in range(2):
            wq = hw.clone().requires_grad_()
            (rn.rms_norm_heads(xr, wq, 1e-6).float() * up.float()).sum().backward()
            grads.append(wq.grad)
        return _row_check(lambda b: rn.rms_norm_heads(xr[:b], hw, 1e-6), R, sz.batches) and \
            torch.equal(grads[0], grads[1]) and bool(torch.isfinite(grads[0]).all())

    check("rms_norm_heads", heads_norm)
    IH, ID, DQ, DV, TOPK, PAGE = 7, 24, 40, 24, 5, 5
    Wc, key_off = DQ + ID + 3, DQ + 3
    lens = [37, 6, 13, 29] if sz.interpret else [200, 7, 129, 64, 33]
    n_pages = sum(-(-n // PAGE) for n in lens)
    latent = torch.full((n_pages + 2, PAGE, Wc), float("nan"), dtype=dtype)
    bt = torch.full((len(lens), max(-(-n // PAGE) for n in lens)), -7, dtype=torch.long)
    order = (torch.randperm(n_pages, generator=g) + 2).tolist()
    for si, n in enumerate(lens):
        for pg in range(-(-n // PAGE)):
            bt[si, pg] = order.pop()
            m_ = min(PAGE, n - pg * PAGE)
            latent[bt[si, pg], :m_] = torch.randn(m_, Wc, generator=g).to(dtype)
    latent, bt = latent.to(dev), bt.to(dev)
    rows_sp = [(si, p) for si, n in enumerate(lens) for p in range(n)]
    order_r = torch.randperm(len(rows_sp), generator=g).tolist()  # rows of all sequences interleaved
    rseq = torch.tensor([rows_sp[i][0] for i in order_r], device=dev)
    rpos = torch.tensor([rows_sp[i][1] for i in order_r], device=dev)
    T = len(order_r)
    iq, iw, aq = randn(T, IH, ID), randn(T, IH, dt=f32), randn(T, IH, DQ)
    row_batches = tuple(b for b in (1, 2, 3, 7, 16, 17, 64, 65, T) if b <= T)
    sel = ix.index_topk(iq, iw, latent, bt, rseq, rpos, key_off, ID**-0.5, TOPK)
    check("index_topk", lambda: _row_check(
        lambda b: ix.index_topk(iq[:b], iw[:b], latent, bt, rseq[:b], rpos[:b], key_off, ID**-0.5, TOPK), T,
        row_batches))
    check("sparse_mla_attention", lambda: _row_check(
        lambda b: sa.sparse_mla_attention(aq[:b], latent, bt, rseq[:b], sel[:b], DQ**-0.5, DV), T, row_batches))
    # the TP pieces: row invariance, and 2 "ranks" (half of K's leaves / half of the column
    # blocks each) finished by the same tree equal the one-call form, bit for bit
    kl, nl = K - K % 8, N - N % 8
    xl, wb = x[:, :kl].contiguous(), w[:nl, :kl].contiguous()

    def k_leaves():
        full_k = mm.linear_k_leaves(xl, wb, 8)
        halves = [mm.tree_sum(mm.leaf_partials(xl[:, r * kl // 2:(r + 1) * kl // 2].contiguous(),
                                               wb[:, r * kl // 2:(r + 1) * kl // 2].contiguous(), 4))
                  for r in range(2)]
        return _row_check(lambda b: mm.linear_k_leaves(xl[:b], wb, 8), R, sz.batches) and \
            torch.equal(mm.tree_sum(torch.stack(halves)).to(dtype), full_k)

    def n_blocks():
        full_n = mm.linear_n_blocks(xl, wb, 8)
        return _row_check(lambda b: mm.linear_n_blocks(xl[:b], wb, 8), R, sz.batches) and \
            torch.equal(mm.linear_n_blocks(xl, wb[nl // 2:], 4), full_n[:, nl // 2:])

    check("linear_k_leaves", k_leaves)
    check("linear_n_blocks", n_blocks)
    # the K trap: row invariance at K in 512..4096 (powers of two) and odd K
    for kt in sz.trap_ks:
        xt, wt = randn(R, kt), randn(sz.trap_n, kt, scale=kt**-0.5)
        check(f"linear_K{kt}", lambda xt=xt, wt=wt: _row_check(lambda b: mm.linear(xt[:b], wt), R, sz.trap_batches))
    # the TF32 trap: an fp32 tl.dot without input_precision="ieee" runs TF32 (10-bit mantissa)
    # on a GPU: ||out - ref|| / ||ref|| near 3e-4 against fp64, fp32 products far under 1e-5
    xf, wf = randn(R, 1531, dt=f32), randn(300, 1531, scale=1531**-0.5, dt=f32)
    qf, kf, vf = (randn(2, 40, H if i == 0 else Hkv, D, dt=f32) for i in range(3))
    ref_q = attention_reference(qf.double(), kf.double(), vf.double(), D**-0.5)  # fp64 in, fp64 out
    for name, fn in {"linear_fp32": lambda: _rel_err(mm.linear(xf, wf), xf.double() @ wf.double().T),
                     "lm_head_fp32": lambda: _rel_err(lm.lm_head_logits(xf, wf), xf.double() @ wf.double().T),
                     "attention_fp32": lambda: _rel_err(at.attention_dense(qf, kf, vf, D**-0.5), ref_q)}.items():
        TRAP_ERRORS[name] = _guarded(f"tf32_trap_{name}", fn, float("nan"), float)
        checks[f"tf32_trap_{name}"] = TRAP_ERRORS[name] < 1e-5
    # attention: sequences alone vs in batches; prefixes; paged decode of b sequences == dense rows
    S, L = sz.seqs, sz.seq_len
    q, kk, vv = randn(S, L, H, D), randn(S, L, Hkv, D), randn(S, L, Hkv, D)
    scale = D**-0.5
    dense = at.attention_dense(q, kk, vv, scale)
    check("attention_dense", lambda: _row_check(lambda b: at.attention_dense(q[:b], kk[:b], vv[:b], scale), S,
                                                sz.seq_batches) and all(
        torch.equal(at.attention_dense(q[:, :n], kk[:, :n], vv[:, :n], scale), dense[:, :n]) for n in (1, 31, 32, 33)))
    page = 16
    per = -(-L // page)
    cache = torch.full((S * per + 1, Hkv, 2, page, D), float("nan"), device=dev, dtype=dtype)
    table = torch.randperm(S * per + 1, generator=g)[: S * per].view(S, per).to(device=dev, dtype=torch.int32)
    p_all = torch.arange(L, device=dev)
    for s in range(S):
        at.kv_cache_write(cache, kk[s], vv[s], table[s, p_all // page].long() * page + p_all % page)
    lens = torch.randint(1, L + 1, (S,), generator=g).to(dev)
    qd = torch.stack([q[s, int(lens[s]) - 1] for s in range(S)])

    def decode(b):
        qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
        return at.attention_paged(qd[:b], cache, qsl, lens[:b].to(torch.int32), table[:b], scale, 1)

    want = torch.stack([dense[s, int(lens[s]) - 1] for s in range(S)])
    check("attention_paged", lambda: _row_check(decode, S, sz.seq_batches) and torch.equal(decode(S), want))
    # GDN: b sequences of 5 tokens with initial states
    Tn, Hk, Hv, dk, dv = 5, 2, 4, 64, 64
    gq, gk = (l2norm(randn(S * Tn, Hk, dk, dt=f32)).to(dtype) for _ in range(2))
    gv = randn(S * Tn, Hv, dv)
    gg = -torch.nn.functional.softplus(randn(S * Tn, Hv, dt=f32))
    gb = torch.rand(S * Tn, Hv, generator=g).to(dev)
    s0 = randn(S, Hv, dk, dv, scale=0.3, dt=f32)

    def gdn(b):
        cu = torch.arange(b + 1, device=dev) * Tn
        o, st = gd.gdn_recurrent(gq[: b * Tn], gk[: b * Tn], gv[: b * Tn], gg[: b * Tn], gb[: b * Tn], cu, s0[:b])
        return o.view(b, Tn, Hv, dv), st

    check("gdn_recurrent", lambda: _row_check(gdn, S, sz.seq_batches))
    # GDN's causal conv (b sequences of 5 tokens with initial states; C odd) and its L2 norm
    Cc = 37 if sz.interpret else 1031
    cx, cw = randn(S * Tn, Cc), randn(Cc, 1, 4, scale=0.5)
    c0 = randn(S, Cc, 3, dt=f32)

    def conv(b):
        y, fin = gd.causal_conv1d(cx[: b * Tn], cw, torch.arange(b + 1, device=dev) * Tn, c0[:b])
        return y.view(b, Tn, Cc), fin

    check("causal_conv1d", lambda: _row_check(conv, S, sz.seq_batches))
    check("gdn_l2norm", lambda: _row_check(lambda b: gd.l2norm(xr[:b]), R, sz.batches))
    return checks


# -- (a') the compiler ------------------------------------------------------------------------

def compiled() -> tuple[dict[str, bool], dict]:
    """Every Triton kernel compiled for sm_90 (titan_rl/kernels/compile_check.py) in a child
    process without TRITON_INTERPRET, PTX free of TF32: the TF32 trap as the compiler shows
    it, which the interpreter (where (a)'s fp64 rows cannot fail) does not. Reported skipped,
    not passed, where this triton has no CUDA backend."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, __file__, "--compile-only"], env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        ERRORS["compiled"] = (out.stderr or out.stdout)[-600:]
        return {"compiled": False}, {}
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    if all(v == "no cuda backend" for v in rows.values()):
        return {}, {"skipped": "this triton has no CUDA backend here", **rows}
    for name, v in rows.items():
        if v not in ("ok", "tf32"):
            ERRORS[f"compiled_{name}"] = v
    return {f"compiled_{name}_no_tf32": v == "ok" for name, v in rows.items()}, rows


# -- (b) model parity ----------------------------------------------------------------------

def model_parity(sz: Sizes, dev) -> tuple[dict[str, bool], dict]:
    """Every registered architecture at its first (debug) flavor: the trainer's dense forward
    vs the paged prefill + decode (titan_rl/paged_decode.py), logits and log-probs."""
    import torch

    from titan_rl import registry
    from titan_rl.kernels import log_softmax_fp32, selfcheck
    from titan_rl.paged_decode import paged_logits

    # under the interpreter: a small vocabulary and MLP (the GEMMs are numpy loops there)
    over = dict(vocab_size=131, intermediate_size=72) if sz.interpret else {}
    B, L = sz.parity_shape
    checks, figures = {}, {}
    for name in registry.list_architectures():
        spec = registry.get_architecture(name)
        flavor = next(iter(spec.flavors))
        for dt_name in sz.parity_dtypes:
            key = f"{name}_{dt_name}"

            def one(dtype=getattr(torch, dt_name)):
                t0 = time.time()
                m = spec.build(flavor, **over).init_weights(1, 0.05).to(device=dev, dtype=dtype).eval()
                tokens = torch.randint(0, m.cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(2)).to(dev)
                with torch.no_grad():
                    dense = m(tokens)
                paged = paged_logits(m, tokens, prefill=3)
                lp = [log_softmax_fp32(t).gather(-1, tokens[..., None]) for t in (dense, paged)]
                figures[key] = {"flavor": flavor, "batch": B, "seq_len": L,
                                "max_dlogp": float((lp[0] - lp[1]).abs().max()),
                                "max_abs_dlogit": float((dense - paged).abs().max()),
                                "seconds": round(time.time() - t0, 2)}
                return torch.equal(dense, paged)

            checks[f"parity_{key}_logits_equal"] = _guarded(f"parity_{key}", one)
            checks[f"parity_{key}_max_dlogp_zero"] = figures.get(key, {}).get("max_dlogp") == 0.0
    if not sz.interpret:  # minutes under the interpreter
        try:
            selfcheck.check_platform(torch.bfloat16, head_dim=128, device=dev)
            checks["selfcheck"] = True
        except Exception as e:  # noqa: BLE001 - PlatformNotInvariant, or the probe broke
            checks["selfcheck"] = False
            ERRORS["selfcheck"] = f"{type(e).__name__}: {e}"[:600]
    return checks, figures


# -- (d) quantization recipes ---------------------------------------------------------------

def recipes(sz: Sizes, dev) -> tuple[dict[str, bool], dict]:
    """Each recipe on the Triton column: the qwen3 debug flavor quantized (every decoder
    linear), trainer dense forward vs paged prefill + decode, logits equal. On CUDA the
    recipes are the dense form (fake-quantized weights and activations through the Triton
    linear, as under the interpreter): one set of bits in both engines, whatever the batch.
    Their quantizers are torchao's primitives: where torchao is not importable (the GPU
    image has none; carry its wheel, README) the recipes are reported skipped, not passed."""
    import torch

    from titan_rl.kernels.quant.recipes import QUANT_RECIPES
    from titan_rl.models import qwen3
    from titan_rl.models.options import ModelOptions, Quantization
    from titan_rl.paged_decode import paged_logits

    try:
        import torchao  # noqa: F401
    except ImportError as e:
        return {}, {"skipped": f"torchao is not importable here ({e}); carry its wheel to run (d)"}
    over = dict(vocab_size=131, intermediate_size=128) if sz.interpret else {}  # widths the blocks divide
    dtype = torch.float32 if sz.interpret else torch.bfloat16
    B, L = (2, 5) if sz.interpret else (8, 64)
    checks, figures = {}, {}
    for recipe in (r for r in QUANT_RECIPES if r != "none"):
        def one(recipe=recipe):
            t0 = time.time()
            m = qwen3.build("debug", ModelOptions(quantization=Quantization(recipe)), **over)
            m = m.init_weights(1, 0.05).to(device=dev, dtype=dtype).eval()
            tokens = torch.randint(0, m.cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(4)).to(dev)
            with torch.no_grad():
                dense = m(tokens)
            paged = paged_logits(m, tokens, prefill=3)
            figures[recipe] = {"dtype": str(dtype), "batch": B, "seq_len": L,
                               "max_abs_dlogit": float((dense - paged).abs().max()),
                               "seconds": round(time.time() - t0, 2)}
            return torch.equal(dense, paged)

        checks[f"recipe_{recipe}_logits_equal"] = _guarded(f"recipe_{recipe}", one)
    return checks, figures


# -- (c) speed (GPU) -----------------------------------------------------------------------

def _ms(fn, reps: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def speed(dev, dtype) -> dict:
    import torch
    import torch.nn.functional as F

    from titan_rl.kernels.attention import triton_impl as at
    from titan_rl.kernels.matmul import triton_impl as mm
    from titan_rl.models import qwen3
    from titan_rl.models.options import ModelOptions

    out = {}
    g = torch.Generator().manual_seed(3)

    def randn(*s):
        return torch.randn(*s, generator=g).to(device=dev, dtype=dtype)

    def timed(name: str, ours_fn, ref_fn, ref_name: str, reps: int = 20) -> None:
        """ours / reference, each the median of `reps` CUDA-event timings; a failure is kept."""
        def both():
            ours, ref = _ms(ours_fn, reps), _ms(ref_fn, reps)
            return {"ours_ms": ours, f"{ref_name}_ms": ref, "ratio": ours / ref}

        row = _guarded(f"speed {name}", both, None, lambda r: r)
        if row is not None:
            out[name] = row

    for M, K, N in ((1, 4096, 4096), (16, 4096, 4096), (256, 4096, 4096), (4096, 4096, 4096), (4096, 512, 1536),
                    (4096, 4096, 12288)):
        x, w = randn(M, K), randn(N, K) * K**-0.5
        timed(f"linear M={M} K={K} N={N}", lambda x=x, w=w: mm.linear(x, w), lambda x=x, w=w: F.linear(x, w), "cublas")
    for B, L, H, Hkv, D in ((4, 1024, 16, 8, 128), (1, 4096, 32, 8, 128)):
        q, k, v = randn(B, L, H, D), randn(B, L, Hkv, D), randn(B, L, Hkv, D)
        s = D**-0.5
        timed(f"attention B={B} L={L} H={H}/{Hkv} D={D}", lambda q=q, k=k, v=v, s=s: at.attention_dense(q, k, v, s),
              lambda q=q, k=k, v=v, s=s: F.scaled_dot_product_attention(
                  q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=s, enable_gqa=True),
              "sdpa")
    exact = qwen3.build("small").init_weights(1).to(device=dev, dtype=dtype)
    stock = qwen3.build("small", ModelOptions(kernels="stock")).to(device=dev, dtype=dtype)
    stock.load_state_dict(exact.state_dict())
    cfg = exact.cfg
    B, C, page = 32, 512, 16
    per = C // page + 1
    caches = [randn(B * per, cfg.num_key_value_heads, 2, page, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
    table = torch.arange(B * per, device=dev, dtype=torch.int32).view(B, per)
    kd = [randn(B, cfg.num_key_value_heads, C + 1, cfg.head_dim) for _ in range(2)]
    ids = torch.randint(0, cfg.vocab_size, (B,), generator=g).to(dev)
    pos = torch.full((B,), C, device=dev)
    qsl = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), C + 1, device=dev, dtype=torch.int32)
    slots = table[:, C // page].long() * page + C % page
    s = 1 / math.sqrt(cfg.head_dim)

    def paged(i, q, k, v):
        at.kv_cache_write(caches[i], k, v, slots)
        return at.attention_paged(q, caches[i], qsl, lens, table, s, 1)

    def sdpa(i, q, k, v):  # q [B, H, D]; this step's k/v into a dense [B, Hkv, C + 1, D] cache
        kd[0][:, :, C], kd[1][:, :, C] = k, v
        return F.scaled_dot_product_attention(q[:, :, None], kd[0], kd[1], scale=s, enable_gqa=True)[:, :, 0]

    with torch.no_grad():
        timed(f"decode step small B={B} context={C}", lambda: exact.logits(exact.hidden_states(ids, pos, paged)),
              lambda: stock.logits(stock.hidden_states(ids, pos, sdpa)), "stock")
    tokens = torch.randint(0, cfg.vocab_size, (8, 512), generator=g).to(dev)

    def step(m):
        m.zero_grad(set_to_none=True)
        m(tokens).float().log_softmax(-1).mean().backward()

    timed("trainer fwd+bwd small B=8 L=512", lambda: step(exact), lambda: step(stock), "stock", reps=5)
    return out


def main() -> int:
    args = _args()
    if args.compile_only:
        _import_titan_rl()
        from titan_rl.kernels.compile_check import check_all

        print(json.dumps(check_all()))
        return 0
    if args.cpu_interpret:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] != "1":
            raise SystemExit("--cpu-interpret needs TRITON_INTERPRET=1")
    _import_titan_rl()
    import torch

    from titan_rl.kernels import dispatch
    from titan_rl.kernels.selfcheck import platform_choices

    if args.cpu_interpret:
        from titan_rl.kernels.interpreter import pin_interpreter_dot

        pin_interpreter_dot()
        dev, backend = torch.device("cpu"), dispatch.use_backend("triton")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu-interpret under TRITON_INTERPRET=1")
        dev, backend = torch.device("cuda"), dispatch.use_backend("triton")
    sz = Sizes(args.cpu_interpret)
    dtype = getattr(torch, sz.dtype)
    t0 = time.time()
    result = {"mode": "cpu-interpret" if args.cpu_interpret else "gpu",
              "machine": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "triton": __import__("triton").__version__}}
    checks: dict[str, bool] = {}

    def save(stage: str) -> None:
        """The JSON so far (a run cut short by its time limit still leaves what it measured)."""
        result.update(stage=stage, errors=ERRORS, checks=checks, seconds=round(time.time() - t0, 1))
        print(f"[{result['seconds']:7.1f} s] {stage}", flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")

    with backend:
        result["dispatch"] = _guarded("dispatch", lambda: dispatch.choices(dev), None, lambda r: r)
        result["platform"] = _guarded("platform", lambda: platform_choices(dev), None, lambda r: r)
        save("started")
        checks.update({f"invariance_{k}": v for k, v in invariance(sz, dev, dtype).items()})
        result["tf32_trap_rel_errors"] = TRAP_ERRORS
        result["seconds_a"] = round(time.time() - t0, 1)
        save("(a) invariance done")
        compile_checks, result["compiled"] = compiled()
        checks.update(compile_checks)
        save("(a') compiled for sm_90 done")
        parity, figures = model_parity(sz, dev)
        checks.update(parity)
        result["parity"] = figures
        result["seconds_b"] = round(time.time() - t0 - result["seconds_a"], 1)
        save("(b) parity done")
        if not args.cpu_interpret:
            result["speed"] = speed(dev, dtype)
        # the GPU image has none of these: the path (a)-(c) check must not need them
        checks["imports_only_torch_and_triton"] = not any(m in sys.modules for m in ("vllm", "torchtitan", "torchao"))
        save("(c) speed done" if not args.cpu_interpret else "(c) skipped under the interpreter")
        recipe_checks, result["recipes"] = recipes(sz, dev)
        checks.update(recipe_checks)
    result["all_passed"] = all(checks.values())
    save("done")
    print(f"{'check':<40} result")
    for name, ok in checks.items():
        print(f"{name:<40} {'ok' if ok else 'FAILED'}")
    for name, row in result.get("speed", {}).items():
        ref = next(v for key, v in row.items() if key.endswith("_ms") and key != "ours_ms")
        print(f"{name:<40} ours {row['ours_ms']:.3f} ms  ref {ref:.3f} ms  ratio {row['ratio']:.2f}")
    for name, err in ERRORS.items():
        print(f"error in {name}: {err[:300]}")
    print(f"all checks {'passed' if result['all_passed'] else 'FAILED'} in {result['seconds']} s")
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
