"""Guard test: pins the measured platform facts exact mode is built on.

For the kernels both engines call (padded linear, rms_norm, log_softmax, the compiled
silu_mul and attention, RoPE), every row computed in a batch must have the bits of the
same row computed alone, across row counts (1..130 and some larger), K, N and widths
that are not multiples of 16 or 64, dtype and torch thread count. If a
torch / MKL / oneDNN upgrade or a new CPU breaks one of these facts, this test names the
failing parameters; kernels/selfcheck.py then refuses exact mode at start-up.
"""

import os
import subprocess
import sys

import pytest
import torch

from titan_rl.kernels import selfcheck
from titan_rl.kernels.attention.torch_impl import attention_dense
from titan_rl.kernels.elementwise import rope, silu_mul
from titan_rl.kernels.lm_head.torch_impl import log_softmax_fp32
from titan_rl.kernels.matmul import torch_impl as mm
from titan_rl.kernels.matmul.torch_impl import linear
from titan_rl.kernels.rmsnorm.torch_impl import rms_norm

ROWS = list(range(1, 131)) + [200, 257]  # row counts swept (the input has 257 rows)
SUFFIX_ROWS = [1, 2, 63, 64, 65, 127, 128, 129, 200]  # also the LAST M rows: other tile positions
# Rows whose lone result is computed (one call each): all of the first 130, then the
# 64-row tile edges and the ends; rows beyond 130 are compared only at these.
ALONE = sorted(set(range(130)) | {191, 192, 193, 199, 200, 255, 256})
SPARSE_ROWS = [1, 2, 3, 7, 8, 63, 64, 65, 127, 128, 129, 200, 257]  # for the costly shapes
DTYPES = [torch.float32, torch.bfloat16]


def _sweep(fn, x, what, rows=ROWS):
    """fn(x[:M]) (and fn(x[-M:]) for M in SUFFIX_ROWS) must give, for every row, the bits
    of fn on that row alone, for every M in rows. Fails listing every bad (M, row)."""
    idx = [i for i in ALONE if i < x.shape[0]]
    alone = dict(zip(idx, torch.cat([fn(x[i : i + 1]) for i in idx])))
    bad = []
    for m in rows:
        for name, start in (("first", 0), ("last", x.shape[0] - m)):
            if name == "last" and m not in SUFFIX_ROWS:
                continue
            got = fn(x[start : start + m])
            bad += [f"M={m} ({name} rows): row {i} differs" for i in range(start, start + m)
                    if i in alone and not torch.equal(got[i - start], alone[i])]
    assert not bad, (f"{what} NOT row-invariant on this platform (threads {torch.get_num_threads()}, "
                     f"{len(bad)} bad rows): " + "; ".join(bad[:8]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,N", [(64, 256), (256, 512), (1024, 384), (3072, 256)])
def test_linear_rows_invariant(K, N, dtype, at_1_and_2_threads, rng):
    w = (torch.randn(N, K, generator=rng) * K**-0.5).to(dtype)
    x = torch.randn(max(ROWS), K, generator=rng).to(dtype)
    _sweep(lambda t: linear(t, w), x, f"linear K={K} N={N} dtype={dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 128, 1024, 3072])
def test_rms_norm_rows_invariant(hidden, dtype, at_1_and_2_threads, rng):
    w = (1 + 0.1 * torch.randn(hidden, generator=rng)).to(dtype)
    x = torch.randn(max(ROWS), hidden, generator=rng).to(dtype)
    _sweep(lambda t: rms_norm(t, w, 1e-6), x, f"rms_norm hidden={hidden} dtype={dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [1000, 32000])
def test_log_softmax_rows_invariant(V, dtype, at_1_and_2_threads, rng):
    x = (4 * torch.randn(max(ROWS), V, generator=rng)).to(dtype)
    _sweep(log_softmax_fp32, x, f"log_softmax_fp32 V={V} input dtype={dtype}",
           rows=ROWS if V <= 1000 else SPARSE_ROWS)


def test_log_softmax_rows_invariant_full_vocab(at_1_and_2_threads, rng):
    """A Qwen-sized vocabulary (151936) on fewer row counts (memory)."""
    x = 4 * torch.randn(130, 151936, generator=rng)
    full = log_softmax_fp32(x)
    for i in (0, 1, 63, 64, 65, 129):
        assert torch.equal(log_softmax_fp32(x[i : i + 1]), full[i : i + 1]), f"V=151936 row {i}"
    for m in (2, 7, 64, 65, 129):
        assert torch.equal(log_softmax_fp32(x[:m]), full[:m]), f"V=151936 first {m} rows"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,N", [(96, 200), (200, 96), (96, 1000), (1000, 96), (13, 7), (33, 8)])
@pytest.mark.parametrize("bf16_gemm", sorted({mm.bf16_gemm(), "fp32"}))
def test_linear_rows_invariant_odd_sizes(K, N, dtype, bf16_gemm, at_1_and_2_threads, rng, monkeypatch):
    """Widths that are not multiples of 16 or 64 (the hidden-96 / intermediate-200 /
    vocab-1000 checkpoint shapes, a router), in this platform's bf16 GEMM form and in the
    upcast-to-fp32 form used where the CPU has no bf16 instructions."""
    monkeypatch.setattr(mm, "BF16_GEMM", bf16_gemm)
    w = (torch.randn(N, K, generator=rng) * K**-0.5).to(dtype)
    x = torch.randn(max(ROWS), K, generator=rng).to(dtype)
    _sweep(lambda t: linear(t, w), x, f"linear K={K} N={N} dtype={dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [7, 96, 100, 200, 768, 1000])
def test_silu_mul_rows_invariant(width, dtype, at_1_and_2_threads, rng):
    """F.silu fails this at widths 100/200 (scalar tail); the compiled op must not."""
    x = (3 * torch.randn(max(ROWS), 2 * width, generator=rng)).to(dtype)
    _sweep(lambda t: silu_mul(t[:, :width], t[:, width:]), x, f"silu_mul width={width} dtype={dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_rope_rows_invariant(d, dtype, at_1_and_2_threads, rng):
    x = torch.randn(max(ROWS), 3, d, generator=rng).to(dtype)
    pos = torch.randint(0, 3000, (max(ROWS),), generator=rng)
    alone = torch.cat([rope(x[i : i + 1], pos[i : i + 1], 1e6) for i in range(130)])
    bad = [m for m in ROWS if not torch.equal(rope(x[:m], pos[:m], 1e6)[:130], alone[:m])]
    assert not bad, f"rope d={d} dtype={dtype} (threads {torch.get_num_threads()}): M={bad[:8]} differ"


@pytest.mark.parametrize("D,G", [(64, 2), (128, 1), (256, 4)])
def test_attention_rows_invariant(D, G, at_1_and_2_threads, rng):
    """The compiled attention: every row of a batch of sequences (prefill chunks mixed
    with decodes) equals the same row computed alone as a one-row decode."""
    S, L, Hkv = 5, 70, 2
    q = torch.randn(S, L, Hkv * G, D, generator=rng)
    k, v = torch.randn(S, L, Hkv, D, generator=rng), torch.randn(S, L, Hkv, D, generator=rng)
    full = attention_dense(q, k, v, D**-0.5)
    bad = []
    for s in range(S):
        for t in (0, 1, 15, 16, 17, 33, L - 1):
            one = attention_dense(q[s:s + 1, : t + 1], k[s:s + 1, : t + 1], v[s:s + 1, : t + 1], D**-0.5)
            if not torch.equal(one[0, t], full[s, t]):
                bad.append((s, t))
    assert not bad, f"attention D={D} G={G} (threads {torch.get_num_threads()}): rows {bad[:8]} differ"


def test_sweep_catches_a_batch_dependent_kernel(rng):
    """The guard itself can fail: a linear whose rows drift in big batches is reported."""
    x = torch.randn(max(ROWS), 64, generator=rng)
    w = torch.randn(32, 64, generator=rng)
    with pytest.raises(AssertionError, match="M=100 .first rows.: row 0 differs"):
        _sweep(_broken(lambda t: linear(t, w)), x, "broken linear")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_check_platform_passes_here(dtype, at_1_and_2_threads):
    selfcheck.clear_cache()
    selfcheck.check_platform(dtype)  # quick probe
    selfcheck.check_platform(dtype)  # cached


def _broken(fn):
    """fn, but the first output element drifts when the call is big (>= 100 rows): the
    shape of bug a kernel that depends on the batch size has."""
    def g(*args, **kw):
        out = fn(*args, **kw)
        if args[0].shape[:-1].numel() >= 100:
            out = out.clone()
            out.view(-1)[0] = out.view(-1)[0] * 1.05 + 0.05
        return out
    return g


@pytest.mark.parametrize("op", ["linear", "rms_norm", "log_softmax_fp32", "lm_head_logits",
                                "attention_dense", "attention_paged", "silu_mul", "rope"])
def test_check_platform_catches_a_broken_kernel(op):
    broken = _broken(selfcheck._default_ops()[op])
    with pytest.raises(selfcheck.PlatformNotInvariant) as e:
        selfcheck.check_platform(torch.bfloat16, ops={op: broken})
    msg = str(e.value)
    assert op in msg and "threads" in msg and "kernels='stock'" in msg, msg
    assert ("bfloat16" in msg) or (op in ("lm_head_logits", "log_softmax_fp32") and "float32" in msg), msg


def test_check_platform_checks_the_installed_linear_and_caches(monkeypatch):
    """The default probe calls torch_impl.linear as installed (looked up at call time);
    a failure is cached and re-raised; a pass is cached and costs nothing."""
    from titan_rl.kernels.matmul import torch_impl as mm

    selfcheck.clear_cache()
    try:
        monkeypatch.setattr(mm, "linear", _broken(mm.linear))
        with pytest.raises(selfcheck.PlatformNotInvariant, match="linear"):
            selfcheck.check_platform(torch.float32)
        calls = []
        monkeypatch.setattr(mm, "linear", lambda *a, **k: calls.append(1))
        with pytest.raises(selfcheck.PlatformNotInvariant, match="linear"):
            selfcheck.check_platform(torch.float32)  # the cached failure, nothing re-run
        assert not calls
    finally:
        monkeypatch.undo()
        selfcheck.clear_cache()
    selfcheck.check_platform(torch.float32)
    monkeypatch.setattr(mm, "linear", lambda *a, **k: calls.append(1))
    selfcheck.check_platform(torch.float32)  # cached pass: the (now useless) linear is not called
    assert not calls
    monkeypatch.undo()
    selfcheck.clear_cache()


# -- across thread counts: the same inputs, the same bits at 1, 2 (and 4 where the machine
# has 4 cores); the layout tests and the contract rely on it (the thread count is not an entry)

THREAD_COUNTS = [1, 2] + ([4] if (__import__("os").cpu_count() or 1) >= 4 else [])


def _at_threads(fn):
    """fn() at each of THREAD_COUNTS (the outputs, in order)."""
    from _threads import threads

    out = []
    for n in THREAD_COUNTS:
        with threads(n):
            out.append(fn())
    return out


def _same(outs, what):
    flat = [o if isinstance(o, (list, tuple)) else [o] for o in outs]
    for n, got in zip(THREAD_COUNTS[1:], flat[1:]):
        for i, (a, b) in enumerate(zip(flat[0], got)):
            # None: a parameter no token reached (an expert nobody routed to), at every count
            same = (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            assert same, f"{what}: output {i} differs at {n} threads vs {THREAD_COUNTS[0]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_are_thread_count_invariant(dtype, rng):
    from titan_rl.kernels.attention.torch_impl import attention_paged, kv_cache_write
    from titan_rl.kernels.gdn import gdn_recurrent
    from titan_rl.kernels.lm_head.torch_impl import lm_head_logits

    x = torch.randn(300, 1000, generator=rng).to(dtype)
    w = (torch.randn(200, 1000, generator=rng) * 1000**-0.5).to(dtype)
    _same(_at_threads(lambda: linear(x, w)), "linear [300, 1000] x [200, 1000]^T")
    wh = torch.randn(3000, 1000, generator=rng) * 1000**-0.5
    _same(_at_threads(lambda: lm_head_logits(x, wh)), "lm_head_logits")
    _same(_at_threads(lambda: log_softmax_fp32(4 * torch.randn(64, 151936, generator=torch.Generator().manual_seed(1)))),
          "log_softmax_fp32 V=151936")
    _same(_at_threads(lambda: rms_norm(x, torch.ones(1000, dtype=dtype), 1e-6)), "rms_norm")
    _same(_at_threads(lambda: silu_mul(x[:, :500], x[:, 500:])), "silu_mul")
    q, k, v = (torch.randn(3, 90, h, 64, generator=rng).to(dtype) for h in (4, 2, 2))
    _same(_at_threads(lambda: attention_dense(q, k, v, 0.125)), "attention_dense")
    pos = torch.randint(0, 3000, (300,), generator=rng)
    _same(_at_threads(lambda: rope(x[:, :192].reshape(300, 3, 64), pos, 1e6)), "rope")

    def paged():
        kv = torch.zeros(8, 2, 2, 32, 64, dtype=dtype)
        table = torch.arange(8).view(2, 4)
        for s in range(2):
            kv_cache_write(kv, k[s, :90], v[s, :90], table[s, torch.arange(90) // 32] * 32 + torch.arange(90) % 32)
        qs = torch.cat([q[0, 89:90], q[1, 40:90]])
        return attention_paged(qs, kv, torch.tensor([0, 1, 51]), torch.tensor([90, 90]), table, 0.125)

    _same(_at_threads(paged), "attention_paged")
    T, H, D = 40, 3, 32
    g = torch.Generator().manual_seed(2)
    args = (torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g),
            -torch.rand(T, H, generator=g), torch.rand(T, H, generator=g), torch.tensor([0, 17, 40]), None)
    _same(_at_threads(lambda: gdn_recurrent(*args, scale=D**-0.5)), "gdn_recurrent")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_backward_is_thread_count_invariant(dtype, rng):
    """Both backward GEMMs of `linear` and of the column-block form, at every row count an
    expert can get (1..24: MoE groups are small and odd; torch.mm's input gradient varied
    with the thread count at 5..11 rows) and a tall one, odd K and N."""
    from titan_rl.kernels.matmul.torch_impl import linear_n_blocks

    K, N = 203, 77
    w0 = (torch.randn(N, K, generator=rng) * K**-0.5).to(dtype)
    w2 = (torch.randn(2 * N, K, generator=rng) * K**-0.5).to(dtype)
    for m in list(range(1, 25)) + [2051]:
        x0 = torch.randn(m, K, generator=rng).to(dtype)
        gy = torch.randn(m, N, generator=rng).to(dtype)
        gy2 = torch.randn(m, 2 * N, generator=rng).to(dtype)

        def grads(x0=x0, gy=gy, gy2=gy2):
            x, w, wb = x0.clone().requires_grad_(), w0.clone().requires_grad_(), w2.clone().requires_grad_()
            gx, gw = torch.autograd.grad(linear(x, w), (x, w), gy)
            bx, bw = torch.autograd.grad(linear_n_blocks(x, wb, 2), (x, wb), gy2)
            return [gx, gw, bx, bw]

        _same(_at_threads(grads), f"linear backward M={m} K={K} N={N} {dtype}")


# Every registered architecture at its debug flavor, unquantized in fp32 and bf16, and in bf16
# under every quantization recipe its flavor's widths admit: fp8_rowwise scales rows, so any K;
# the block recipes (fp8_block 128 x 128, mxfp8 1 x 32, nvfp4 1 x 16) need K a multiple of the
# block, which the 200-wide debug flavors of Qwen3.5, Qwen3-Next and GLM-5 are not (refused at
# build, naming the linear: kernels/quant).
STEP_ARCHS = {"qwen3": "debug", "llama": "debug", "qwen3_moe": "debug_moe", "qwen3_hybrid": "debug_hybrid",
              "qwen3_5": "debug_qwen35", "qwen3_5_moe": "debug_qwen35_moe", "qwen3_next": "debug_qwen3_next",
              "glm_moe_dsa": "debug_glm5"}
ALL_RECIPES = ("fp8_rowwise", "fp8_block", "mxfp8", "nvfp4", "nvfp4_w4a4")
ROW_RECIPES_ONLY = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "glm_moe_dsa"}
STEP_CASES = ([(a, "none", dt) for a in STEP_ARCHS for dt in DTYPES]
              + [(a, r, torch.bfloat16) for a in STEP_ARCHS
                 for r in (("fp8_rowwise",) if a in ROW_RECIPES_ONLY else ALL_RECIPES)])


def test_the_step_cases_cover_every_registered_architecture():
    from titan_rl.registry import list_architectures

    assert sorted(STEP_ARCHS) == sorted(list_architectures())


@pytest.mark.parametrize("arch,recipe,dtype", STEP_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_a_training_step_is_thread_count_invariant(arch, recipe, dtype, rng):
    """One training step of the trainer's model: the forward, the loss, every parameter
    gradient (backward GEMMs included), the clipping norm and the weights after an AdamW step
    (weight decay on), at each thread count: the same bits. The quantized recipes run the form
    this CPU runs (`platform.quant_gemm`)."""
    from titan_rl.models.options import ModelOptions, Quantization
    from titan_rl.registry import get_architecture
    from titan_rl.titan.leaf_reduction import grad_norm

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    tokens = torch.randint(0, 900, (5, 41), generator=rng)
    options = ModelOptions(quantization=Quantization(recipe))

    def step():
        m = get_architecture(arch).build(STEP_ARCHS[arch], options).init_weights(seed).to(dtype)
        logits = m(tokens)
        loss = logits.float().log_softmax(-1)[..., 5].mean()
        loss.backward()
        grads = [p.grad.clone() if p.grad is not None else None for p in m.parameters()]
        norm = grad_norm(m.parameters())
        torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1).step()
        return [logits.detach(), loss.detach(), norm, *grads, *(p.detach() for p in m.parameters())]

    _same(_at_threads(step), f"{arch} {recipe} {dtype} training step")


def test_onednn_cap_is_set_on_amx_cpus_only_and_never_over_a_choice(monkeypatch):
    from titan_rl import onednn_cap

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(onednn_cap, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    onednn_cap.apply()
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ
    monkeypatch.setattr(onednn_cap, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_bf16"})
    onednn_cap.apply()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == onednn_cap.CAP
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    onednn_cap.apply()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


@pytest.mark.skipif("amx_bf16" not in __import__("titan_rl.onednn_cap").onednn_cap.cpu_flags()
                    or os.environ.get("TITAN_RL_CPU") == "avx2",
                    reason="no AMX on this CPU (or masked as AVX2): oneDNN's bf16 GEMM is invariant uncapped")
def test_on_amx_the_uncapped_bf16_gemm_is_caught_and_the_fp32_form_taken():
    """On an AMX CPU, oneDNN left uncapped (ONEDNN_MAX_CPU_ISA=ALL) gives row-count-dependent
    bf16 GEMMs: the probe sees it and the bf16 linears take the fp32 form; capped (titan_rl's
    default) they run native."""
    code = "import titan_rl; from titan_rl.kernels.matmul import torch_impl as t; print(t.bf16_gemm())"
    forms = {}
    for isa in ("ALL", None):
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        if isa:
            env["ONEDNN_MAX_CPU_ISA"] = isa
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        forms[isa] = out.stdout.split()[-1]
    assert forms == {"ALL": "fp32", None: mm.bf16_gemm()}
    assert mm.bf16_gemm() == "native"


_LINUX_ONLY = pytest.mark.skipif(os.uname().sysname != "Linux", reason="glibc's thresholds are a Linux matter")


def _env_without_tunables() -> dict:
    """This environment as a shell would give it: without the GLIBC_TUNABLES titan_rl's import
    exported here (a process started with them keeps memory whatever its policy)."""
    return {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}


def _malloc_probe(code: str, env: dict) -> str:
    """The stdout of `python -c code` under env (a fresh process: glibc's choices are per process)."""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@_LINUX_ONLY
def test_glibc_keeps_freed_memory_unless_told_not_to():
    """titan_rl's import sets glibc's thresholds through mallopt in a process that did not start
    with its tunables (titan_rl/malloc.py; the other way is the next test's), so a training step's
    buffers come back from the heap instead of being faulted in afresh every step (a zeroed
    4 KiB page each, about 1 us); TITAN_RL_MALLOC=system leaves glibc's defaults. A 2-layer
    small-flavor exact step (4 x 128 tokens) measured 5.5 thousand minor faults against 89
    thousand (Intel Xeon, 2026-12-05)."""
    code = ("import resource, torch, titan_rl.malloc as m\n"
            "from titan_rl.models.qwen3 import build\n"
            "from titan_rl.models.options import ModelOptions\n"
            "torch.set_num_threads(1)\n"
            "model = build('small', ModelOptions(kernels='exact'), num_hidden_layers=2).init_weights(0)\n"
            "tokens = torch.randint(0, model.cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))\n"
            "def step():\n"
            "    model(tokens).log_softmax(-1).mean().backward(); model.zero_grad(set_to_none=True)\n"
            "step(); step()\n"
            "f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(3): step()\n"
            "print(m.apply(), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) // 3)\n")
    got = {}
    for policy in ("keep", "system"):
        applied, faults = _malloc_probe(code, {**_env_without_tunables(), "TITAN_RL_MALLOC": policy}).split()[-2:]
        got[policy] = (applied, int(faults))
    assert got["keep"][0] == "True" and got["system"][0] == "False", got
    assert got["keep"][1] * 4 < got["system"][1], got


@_LINUX_ONLY
def test_glibc_keeps_more_than_a_gib_freed_at_once():
    """A step that frees several vocabulary-sized buffers together (SmolLM2's fp32 logits,
    log-softmax and their gradients: 400 MB each) must get them back from the heap next step.
    Two things stood in the way (titan_rl/malloc.py): a trim threshold of 1 GiB gave the freed
    top of the heap back, and glibc's per-thread cache kept the small blocks between large
    buffers, so a freed buffer could not merge and the next request took fresh memory. Three
    buffers of 448 MB freed together, three rounds, in a program that starts as a main program
    does (`restart_with_tunables` first, from an environment without the tunables): it restarts
    itself once (same PID) and its later rounds fault (almost) nothing in, where glibc's
    defaults fault every page each round."""
    code = ("import os, sys\n"
            "print('pid', os.getpid(), flush=True)\n"
            "from titan_rl.malloc import restart_with_tunables\n"
            "restart_with_tunables()\n"
            "import resource, torch, titan_rl.malloc as m\n"
            "def flt(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "per = []\n"
            "for _ in range(3):\n"
            "    f0 = flt(); bufs = [torch.empty(112 << 20).fill_(1.0) for _ in range(3)]\n"
            "    per.append(flt() - f0); del bufs\n"
            "print(m.apply(), m.STARTED_WITH_TUNABLES, per[1] + per[2])\n")
    got = {}
    for policy in ("keep", "system"):
        stdout = _malloc_probe(code, {**_env_without_tunables(), "TITAN_RL_MALLOC": policy, "OMP_NUM_THREADS": "1"})
        pids = [line.split()[1] for line in stdout.splitlines() if line.startswith("pid ")]
        applied, started_with, faults = stdout.split()[-3:]
        got[policy] = (pids, applied, started_with, int(faults))
    pages = 2 * 3 * (448 << 20) // 4096  # the later rounds' pages
    pids, applied, started_with, faults = got["keep"]
    assert len(pids) == 2 and pids[0] == pids[1], got  # restarted once, in place
    assert (applied, started_with) == ("True", "True") and faults < pages // 20, got
    pids, applied, started_with, faults = got["system"]
    assert len(pids) == 1 and (applied, started_with) == ("False", "False"), got
    assert faults > pages // 2, got  # the probe sees faults where memory is given back
