"""Start-up probe: does exact mode's batch invariance hold on THIS platform?

Exact mode rests on measured facts about the BLAS/oneDNN/ATen build, the CPU and the
thread count (docs/kernels.md), not on guarantees. So before serving or training in
exact mode, `check_platform` runs the kernels exact mode calls on small fixed inputs and
asserts with torch.equal that a row's bits do not depend on how many rows share the
call: linear over row counts 1, 2, 63, 64, 65, 200 and K up to >= 1024 (odd K and N too), the
quantized GEMM where it runs (bf16 on AVX512-BF16: fp8_rowwise, nvfp4, nvfp4_w4a4),
the fp32 LM-head GEMM, rms_norm, log_softmax, silu_mul at widths that are not multiples of
16, RoPE, attention_dense (prefix vs full, one sequence vs a batch) and attention_paged
(decode / chunked prefill vs dense); then that each op's output is the same at 1, 2 and
the current torch thread count (`threads_compared`), so the thread count is not a
bit-relevant choice. Any mismatch raises PlatformNotInvariant naming the op, shape, dtype
and thread count. There is deliberately
no environment-variable escape hatch: exact mode refuses; the caller may choose
kernels='stock' knowingly instead.

The probe runs on `device` with what the dispatcher (kernels/dispatch.py) picks there:
the CPU kernels for CPU tensors, the Triton ones on CUDA (or forced under the interpreter).
The result (pass or failure) is cached per (dtype, torch thread count, head_dim, device
type, backend), so
repeated calls are free; `clear_cache()` forgets it. Attention is probed at the model's
head_dim. `platform_choices()` names what exact mode chose here (bf16 GEMM form, padding
rules). `ops=` substitutes functions to check (tests use it to prove a broken kernel is
caught); such calls are never cached.
"""

import platform

import torch

QUICK_ROWS = (1, 2, 63, 64, 65, 200)


class PlatformNotInvariant(RuntimeError):
    """A kernel exact mode relies on gave different bits for the same row in batches of
    different sizes (or lengths) on this platform / dtype / thread count."""


_CACHE: dict = {}  # (dtype, threads, head_dim, device type, backend) -> "quick" | "full" | PlatformNotInvariant


def clear_cache() -> None:
    _CACHE.clear()


PROBED = ("linear", "rms_norm", "log_softmax_fp32", "lm_head_logits", "attention_dense", "attention_paged",
          "silu_mul", "rope")


def _default_ops(device: torch.device | str = "cpu") -> dict:
    # What the dispatcher picks for `device`, looked up at call time, so the functions
    # exact mode actually calls are the ones checked.
    from titan_rl.kernels import dispatch

    return {name: dispatch.implementation(name, device) for name in (*PROBED, "kv_cache_write")}


def platform_choices(device: torch.device | str = "cpu") -> dict:
    """The bit-relevant choices exact mode made for this platform (entries of the execution
    contract, titan_rl/contract.py: parity JSON, metrics.jsonl, the report): the
    dispatcher's backend for `device` and that backend's fixed choices."""
    from titan_rl.kernels import dispatch

    backend = dispatch.backend_for(device)
    if backend == "triton":
        import triton

        from titan_rl.kernels.attention import triton_impl as attn
        from titan_rl.kernels.matmul import triton_impl as mm

        kind = torch.device(device).type
        return {"backend": backend, "triton": triton.__version__,
                "device": torch.cuda.get_device_name(device) if kind == "cuda" else "triton interpreter (CPU)",
                "linear_tiles": f"{mm.ROW_TILE}x{mm.BLOCK_N}x{mm.BLOCK_K}, no split-K, no autotune",
                "attention": f"one kernel, KV blocks of {attn.BLOCK} at absolute positions, row tiles of "
                             f"{attn.BLOCK_R}, block table read in the kernel",
                "fp_fusion": False}
    from titan_rl.kernels.matmul import torch_impl as mm

    return {"backend": backend, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "gemm": mm.GEMM,
            "bf16_gemm": mm.bf16_gemm(), "lm_head": _head_form(), "quant_gemm": _quant_gemm_form(),
            # which instructions compute the dpbf16 forms: not bit-relevant (csrc/dpbf16_avx2.h)
            "dpbf16": _dpbf16_implementation(), "linear_row_multiple": mm.ROW_MULTIPLE, "linear_min_n": mm.MIN_N,
            "attention": f"compiled, fixed order per row (kernels/csrc/paged_attention.cpp), bf16 form {_attn_form()}",
            "elementwise": "compiled silu_mul; RoPE from a chunked table",
            # not the thread count itself: the self-check proves the outputs equal at 1, 2 and the current count
            "threads": "not bit-relevant (the self-check compares 1, 2 and the current count)"}


def bit_choices(dtype: torch.dtype, device: torch.device | str = "cpu") -> dict:
    """The platform choices that decide a `dtype` model's bits in exact mode: what a run dir
    records, since a resume where one differs continues the policy with other bits. The CPU
    capability is one (ATen's vectorised log-softmax, which both engines' log-probs use, rounds
    differently at AVX2 and AVX512 width); which instructions compute the dpbf16 forms is not
    (the same bits either way: csrc/dpbf16_avx2.h), nor the thread count. The bf16 forms
    count only for a bf16 model."""
    c = {k: v for k, v in platform_choices(device).items() if k not in ("dpbf16", "threads")}
    if dtype != torch.bfloat16:
        for k in ("bf16_gemm", "lm_head", "quant_gemm"):
            c.pop(k, None)
        if "attention" in c:
            c["attention"] = c["attention"].split(", bf16 form")[0]
    return c


def _attn_form() -> str:
    from titan_rl.kernels.attention.torch_impl import ATTN_FORM

    return ATTN_FORM


def _quant_gemm_form() -> str:
    from titan_rl.kernels.quant.gemm import quant_gemm_form

    return quant_gemm_form()


def _dpbf16_implementation() -> str:
    from titan_rl.kernels.quant.gemm import quant_gemm_implementation

    return quant_gemm_implementation()


def _head_form() -> str:
    from titan_rl.kernels.lm_head.torch_impl import HEAD_FORM

    return HEAD_FORM


class _Probe:
    def __init__(self, dtype, device):
        self.dtype, self.device = dtype, torch.device(device)
        self.threads = torch.get_num_threads()
        self.gen = torch.Generator().manual_seed(1234)

    def randn(self, *shape, dtype=None, scale=1.0):
        return (scale * torch.randn(*shape, generator=self.gen)).to(device=self.device, dtype=dtype or self.dtype)

    def fail(self, op, shape, dtype, what, got, want):
        diff = (got.double() - want.double()).abs().nan_to_num(float("inf"))
        raise PlatformNotInvariant(
            f"titan_rl exact mode: {op} is not batch-invariant on this platform: {what} "
            f"(shape {shape}, dtype {str(dtype).replace('torch.', '')}, torch threads {self.threads}; "
            f"max |diff| {diff.max().item():.3g}). Trainer and sampler log-probs would not match "
            f"bit for bit, so exact mode refuses to run. Options: run with kernels='stock' "
            f"knowingly (log-probs will differ between trainer and sampler), try another thread "
            f"count (torch.set_num_threads), or report the platform (torch {torch.__version__}, "
            f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}, threads {self.threads}) "
            f"with the output of pytest tests/test_invariance_guard.py.")

    def rows(self, op, fn, x, rows, shape, dtype):
        """fn on a prefix, a suffix and single rows must reproduce those rows of fn(x)."""
        full = fn(x)
        for m in rows:
            if m > x.shape[0]:
                continue
            for name, sl in (("first", slice(0, m)), ("last", slice(x.shape[0] - m, None))):
                got = fn(x[sl])
                if not torch.equal(got, full[sl]):
                    self.fail(op, shape, dtype, f"the {name} {m} of {x.shape[0]} rows computed alone differ",
                              got, full[sl])


def _check(ops, dtype, quick, head_dim, device):
    p = _Probe(dtype, device)
    rows = QUICK_ROWS if quick else tuple(range(1, 131)) + (200, 257)
    # Odd K and N too: (200, 96) is an intermediate-200 down projection, (33, 8) a router.
    shapes = [(256, 384), (1024, 256), (200, 96), (33, 8)] if quick else \
        [(64, 256), (256, 512), (1024, 256), (3072, 128), (200, 96), (96, 1000), (33, 8)]
    n_rows = 200 if quick else 300
    for K, N in shapes:
        w = p.randn(N, K, scale=K**-0.5)
        p.rows("linear", lambda t: ops["linear"](t, w), p.randn(n_rows, K), rows, f"[M, {K}] x [{N}, {K}]^T", dtype)
    for what, fn, K in _quant_probes(p, dtype, device):
        p.rows("quant_linear", fn, p.randn(n_rows, K), rows, what, dtype)
    # LM head: fp32 logits from a weight in the model's dtype (bf16: the dpbf16 kernel where
    # the CPU has it, kernels/lm_head), then the fp32 vocabulary reduction.
    V = 2000 if quick else 4096
    w = p.randn(V, 1024, scale=1024**-0.5)
    p.rows("lm_head_logits", lambda t: ops["lm_head_logits"](t, w), p.randn(n_rows, 1024),
           QUICK_ROWS + (() if quick else (127, 128, 129, 257)), f"[M, 1024] x [{V}, 1024]^T", torch.float32)
    V = 2000 if quick else 32000
    p.rows("log_softmax_fp32", ops["log_softmax_fp32"], p.randn(n_rows, V, dtype=torch.float32, scale=4.0),
           rows, f"[M, {V}]", torch.float32)
    for hidden in (128, 1024):  # q/k-norm head_dim and a hidden size
        w = p.randn(hidden, scale=0.1) + 1
        p.rows("rms_norm", lambda t: ops["rms_norm"](t, w, 1e-6), p.randn(n_rows, hidden), rows, f"[M, {hidden}]", dtype)
    for width in (200, 1000) if quick else (7, 100, 200, 1000, 1536):  # not multiples of 16
        p.rows("silu_mul", lambda t: ops["silu_mul"](t[:, :width], t[:, width:]), p.randn(n_rows, 2 * width, scale=3.0),
               rows, f"[M, {width}]", dtype)
    pos = torch.randint(0, 4096, (n_rows,), generator=p.gen).to(p.device)
    x = p.randn(n_rows, 3, head_dim)
    full = ops["rope"](x, pos, 1e6)
    for m in rows:
        got = ops["rope"](x[:m], pos[:m], 1e6)
        if m <= n_rows and not torch.equal(got, full[:m]):
            p.fail("rope", f"[M, 3, {head_dim}]", dtype, f"the first {m} of {n_rows} rows differ", got, full[:m])
    _check_attention(p, ops, dtype, quick, head_dim)


def _check_attention(p, ops, dtype, quick, D):
    B, L, H, Hkv, page, scale = 3, 100, 4, 2, 64, D**-0.5
    q, k, v = p.randn(B, L, H, D), p.randn(B, L, Hkv, D), p.randn(B, L, Hkv, D)
    dense = ops["attention_dense"]
    full = dense(q, k, v, scale)
    shape = f"q [{B}, {L}, {H}, {D}], kv heads {Hkv}"
    for n in (1, 2, 31, 32, 33, 64, 65) if quick else range(1, L):
        got = dense(q[:, :n], k[:, :n], v[:, :n], scale)
        if not torch.equal(got, full[:, :n]):
            p.fail("attention_dense", shape, dtype, f"a length-{n} prefix differs from the full sequence", got, full[:, :n])
    got = dense(q[1:2], k[1:2], v[1:2], scale)
    if not torch.equal(got, full[1:2]):
        p.fail("attention_dense", shape, dtype, "one sequence alone differs from it inside a batch", got, full[1:2])
    # Paged cache (shuffled pages, NaN in unused slots): decode / chunked prefill == dense rows.
    n_pages = B * (-(-L // page)) + 1
    dev = p.device
    kv = torch.full((n_pages, Hkv, 2, page, D), float("nan"), dtype=dtype, device=dev)  # (keys, values)
    table = torch.randperm(n_pages, generator=p.gen)[: B * (-(-L // page))].view(B, -1).to(dev)
    pos = torch.arange(L, device=dev)
    for s in range(B):
        ops["kv_cache_write"](kv, k[s], v[s], table[s, pos // page] * page + pos % page)
    for t in (0, 1, 2, 3, 7, 31, 32, 63, 64, L - 1) if quick else range(L):
        spans = [(t, t + 1), (max(0, t - 6), t + 1), (0, t + 1)]  # decode, chunk, whole prefill
        qs = torch.cat([q[s, a:b] for s, (a, b) in enumerate(spans)])
        qsl = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0).to(dev)
        out = ops["attention_paged"](qs, kv, qsl, torch.tensor([b for _, b in spans], device=dev), table, scale)
        for s, (a, b) in enumerate(spans):
            got = out[qsl[s] : qsl[s + 1]]
            if not torch.equal(got, full[s, a:b]):
                p.fail("attention_paged", f"{shape}, page {page}", dtype,
                       f"sequence {s} positions [{a}, {b}) over the paged cache differ from attention_dense", got, full[s, a:b])


def _quant_probes(p, dtype, device) -> list:
    """(what, fn, K) for the quantized GEMM (kernels/quant/gemm.py) where exact mode runs it
    (bf16 on a CPU with its instructions): each recipe at an odd N, and K not a multiple of 16
    for fp8_rowwise; [] elsewhere."""
    from titan_rl.kernels import dispatch
    from titan_rl.kernels.quant import gemm as qg

    if dtype != torch.bfloat16 or dispatch.backend_for(device) != "torch" or not qg.uses_quant_gemm(
            "fp8_rowwise", dtype, device):
        return []
    out = []
    for recipe, K, N in (("fp8_rowwise", 203, 97), ("nvfp4", 208, 97), ("nvfp4_w4a4", 208, 40)):
        pq = qg.PackedQuant.prepare([p.randn(N, K, scale=K**-0.5)], recipe)[0]
        out.append((f"{recipe} [M, {K}] x [{N}, {K}]^T", lambda t, pq=pq: qg.quant_linear(t, pq), K))
    return out


def threads_compared() -> list[int]:
    """The torch thread counts the probe compares: 1, 2 and the current one."""
    return sorted({1, 2, torch.get_num_threads()})


def _set_threads(n: int) -> None:
    # torch._C's setter (torch.set_num_threads is this function): vLLM's CPU worker replaces
    # torch.set_num_threads with a no-op in its process, which would make the comparison
    # compare one thread count with itself.
    torch._C.set_num_threads(n)
    if torch.get_num_threads() != n:
        raise RuntimeError(f"the self-check could not set torch's thread count to {n} (it stays "
                           f"{torch.get_num_threads()})")


def _outputs(ops, dtype, head_dim, device) -> list[tuple[str, torch.Tensor]]:
    """Each probed op on fixed inputs (the same at every call): what the thread counts must agree on."""
    p = _Probe(dtype, device)
    out = []
    for K, N in ((256, 384), (1024, 256), (200, 96), (33, 8), (3072, 128)):
        out.append((f"linear [200, {K}] x [{N}, {K}]^T", ops["linear"](p.randn(200, K), p.randn(N, K, scale=K**-0.5))))
    w = p.randn(2000, 1024, scale=1024**-0.5)
    out.append(("lm_head_logits [200, 1024] x [2000, 1024]^T", ops["lm_head_logits"](p.randn(200, 1024), w)))
    out.append(("log_softmax_fp32 [200, 32000]", ops["log_softmax_fp32"](p.randn(200, 32000, dtype=torch.float32,
                                                                                    scale=4.0))))
    out.append(("rms_norm [200, 1024]", ops["rms_norm"](p.randn(200, 1024), p.randn(1024, scale=0.1) + 1, 1e-6)))
    x = p.randn(200, 2000, scale=3.0)
    out.append(("silu_mul [200, 1000]", ops["silu_mul"](x[:, :1000], x[:, 1000:])))
    pos = torch.randint(0, 4096, (200,), generator=p.gen).to(p.device)
    out.append((f"rope [200, 3, {head_dim}]", ops["rope"](p.randn(200, 3, head_dim), pos, 1e6)))
    q, k, v = p.randn(3, 100, 4, head_dim), p.randn(3, 100, 2, head_dim), p.randn(3, 100, 2, head_dim)
    out.append((f"attention_dense q [3, 100, 4, {head_dim}]", ops["attention_dense"](q, k, v, head_dim**-0.5)))
    for what, fn, K in _quant_probes(p, dtype, device):
        out.append((f"quant_linear {what}", fn(p.randn(200, K))))
    return out


def _check_threads(ops, dtype, head_dim, device) -> None:
    own = torch.get_num_threads()
    base = _outputs(ops, dtype, head_dim, device)
    try:
        for n in threads_compared():
            if n == own:
                continue
            _set_threads(n)
            for (what, want), (_, got) in zip(base, _outputs(ops, dtype, head_dim, device)):
                if not torch.equal(got, want):
                    _Probe(dtype, device).fail(what.split(" ")[0], what, dtype,
                                               f"the same inputs give other bits at {n} torch threads than at {own}",
                                               got, want)
    finally:
        _set_threads(own)


def check_platform(dtype: torch.dtype = torch.bfloat16, quick: bool = True, *, head_dim: int = 128,
                   ops: dict | None = None, device: torch.device | str = "cpu") -> None:
    """Raise PlatformNotInvariant unless exact mode's kernels are batch-invariant here for
    `dtype` at the current torch thread count (attention at `head_dim`, the model's; 128 for
    Qwen3). quick=True takes well under 2 s; quick=False sweeps more rows/shapes/lengths.
    `ops` overrides some of the checked functions by name (linear, rms_norm,
    log_softmax_fp32, lm_head_logits, attention_dense, attention_paged); not cached.
    `device`: the probe runs there, on what the dispatcher picks for it (kernels/dispatch.py)."""
    from titan_rl.kernels import dispatch

    key = (dtype, torch.get_num_threads(), head_dim, torch.device(device).type, dispatch.backend_for(device))
    if ops is None:
        hit = _CACHE.get(key)
        if isinstance(hit, PlatformNotInvariant):
            raise hit
        if hit == "full" or (hit == "quick" and quick):
            return
    checked = {**_default_ops(device), **(ops or {})}
    with torch.no_grad():
        try:
            _check(checked, dtype, quick, head_dim, device)
            if torch.device(device).type == "cpu":  # GPU kernels do not use torch's CPU threads
                _check_threads(checked, dtype, head_dim, device)
        except PlatformNotInvariant as e:
            if ops is None:
                _CACHE[key] = e
            raise
    if ops is None:
        _CACHE[key] = "quick" if quick else "full"
