"""oneDNN capped below AMX on AMX CPUs: one of the two process choices titan_rl makes at import
(the other: glibc keeps freed memory, malloc.py).

Why (kernels/cpu_features.py has the measurements): oneDNN's AMX bf16 GEMMs give a row bits
that depend on the row count; capped at AVX512_CORE_BF16 they are batch-invariant. oneDNN reads
ONEDNN_MAX_CPU_ISA when it makes its first primitive, so this runs when titan_rl is imported
(before any of our GEMMs) and imports nothing heavy: `python -m titan_rl.train` still sets the
variables torch reads at import before torch loads.
"""

from __future__ import annotations

import os

CAP = "AVX512_CORE_BF16"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def allow_amx_tiles() -> None:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA), as
    oneDNN does before its first AMX kernel. Capped, oneDNN never asks, and vLLM's own CPU
    attention (the stock engine) runs AMX instructions where torch reports AMX: without the
    permission the process dies of SIGILL (seen in the suite's stock Qwen3-Next cells)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return
    try:
        ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
    except (OSError, AttributeError):
        pass


def apply() -> None:
    """On AMX CPUs, ONEDNN_MAX_CPU_ISA = CAP unless it is set already (the masked switch's
    AVX2, or a user's choice), and the AMX tile permission requested for the others that use
    AMX in this process."""
    if "amx_bf16" not in cpu_flags():
        return
    allow_amx_tiles()
    if "ONEDNN_MAX_CPU_ISA" not in os.environ:
        os.environ["ONEDNN_MAX_CPU_ISA"] = CAP
