"""Which x86 CPU kind the kernels run as, and the switch that makes an AVX512 machine run as
an AVX2-only one.

The project's machines come as AVX2-only EPYCs on some days and AVX512 + AVX512-BF16 ones on
others, and several choices follow the CPU: the compiled kernels' forms (the dpbf16 LM head,
attention and quantized GEMM exist only where the compiler targets AVX512-BF16), oneDNN's
bf16 GEMM (native or not), ATen's vector width, and which of vLLM's CPU libraries loads
(`_C`, `_C_AVX512` or `_C_AVX2`, which register different ops, and its GDN layer's conv path).
A suite run on one kind proves nothing about the other, so `TITAN_RL_CPU=avx2` makes every
one of those choices the AVX2 machine's, through each library's own switch:

  * the compiled kernels are built for x86-64-v3 (AVX2 + FMA) into their own build folder,
    so the AVX512 forms are absent from the binary, not merely skipped;
  * ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 (read by torch and oneDNN when they
    load: set in the environment before the process starts, `MASKED_ENV`);
  * torch.cpu's AVX512 and AMX probes answer False (`apply()`), which is how vLLM's CPU
    platform picks its AVX2 library, its GDN layer its torch conv and its attention a non-AMX
    form.

Tests run selected files under `MASKED_ENV` in a child process (tests/test_masked_cpu.py).

A third kind came up as Intel Xeons with AMX (amx_bf16 beside AVX512-BF16). There oneDNN runs
bf16 GEMMs on AMX tiles, and a row's bits then depend on the row count under every row padding
tried (8, 16, 32, 64; measured: hundreds of rows of M = 1..600 differ at K 1024 / N 384 and K
512 / N 3072). Capped at AVX512_CORE_BF16 they are invariant again, as on the EPYCs.
`titan_rl.onednn_cap.apply()` sets that cap (ONEDNN_MAX_CPU_ISA, read when oneDNN makes its
first primitive, so it works after torch is imported but not after a oneDNN GEMM ran); it runs
when titan_rl is imported, and the bf16 GEMM's probe (kernels/matmul/torch_impl.py) falls back
to the fp32 form where the cap came too late.
"""

from __future__ import annotations

import os

ENV = "TITAN_RL_CPU"
KINDS = ("native", "avx2")
# the environment a process needs from its start to run as an AVX2-only machine
MASKED_ENV = {ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def kind() -> str:
    """"avx2" under the switch, else "native" (whatever this CPU is)."""
    value = os.environ.get(ENV, "") or "native"
    if value not in KINDS:
        raise ValueError(f"{ENV} = {value!r} is not a CPU kind titan_rl can run as; allowed: {list(KINDS)}")
    return value


def march() -> str:
    """The compiler's target for the compiled kernels."""
    return "-march=x86-64-v3" if kind() == "avx2" else "-march=native"


def apply() -> None:
    """Under the switch: torch's AVX512 probes answer False (vLLM asks them to choose its
    library and paths). Idempotent; refuses a process whose torch did not start masked."""
    if kind() != "avx2":
        return
    import torch

    missing = {k: v for k, v in MASKED_ENV.items() if os.environ.get(k) != v}
    if missing or torch.backends.cpu.get_cpu_capability() != "AVX2":
        raise RuntimeError(f"{ENV}=avx2 needs the process started with {MASKED_ENV} (torch and oneDNN read "
                           f"them at load); missing or different: {sorted(missing) or 'ATen capability'}")
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    # vLLM's CPU attention takes its AMX form where this says so (an AVX2 machine has none;
    # its AVX2 library then refuses the configuration: seen on an AMX Xeon, 2026-12-05)
    torch.cpu._is_amx_tile_supported = lambda: False
