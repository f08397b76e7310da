"""The compiled CPU kernels (kernels/csrc/*.cpp), built once per machine.

`torch.utils.cpp_extension.load` compiles the sources with g++ into
`$TITAN_RL_BUILD_DIR` (default: `build/` beside the sources) and registers the ops as
`torch.ops.titan_rl.*`. The README's set-up builds it (`python -m titan_rl.kernels.build`);
afterwards the first import only checks the sources' hash (rebuilding if they changed;
concurrent processes, e.g. torchrun ranks, wait on cpp_extension's lock).

Flags: -O3 and the machine's vector ISA for speed (x86-64-v3 under TITAN_RL_CPU=avx2, in a
build folder of its own: kernels/cpu_features.py); -ffp-contract=off and no fast-math
so every element and lane is computed by the same IEEE operations (csrc/common.h).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from titan_rl.kernels.cpu_features import kind, march

_SRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("paged_attention.cpp", "elementwise.cpp", "rowwise.cpp", "bf16_logits.cpp", "stable_sort.cpp",
           "fake_quant.cpp", "dsa.cpp", "quant_gemm.cpp", "weight_grad.cpp", "f32_chain.cpp", "gdn_recurrent.cpp", "causal_conv1d.cpp")
CFLAGS = ("-O3", march(), "-ffp-contract=off", "-fno-fast-math", "-fopenmp")
# -fopenmp: at::parallel_for is inline OpenMP; without it the kernels run on one thread.
# The process already has torch's libgomp.so.1 loaded, which the extension then shares.
LDFLAGS = ("-fopenmp",)
# TITAN_RL_SANITIZE=1 (`make sanitize`): AddressSanitizer + UndefinedBehaviorSanitizer, in a
# build folder of its own; the process must preload the sanitizers' runtimes (the Makefile's
# target does). -O1 and frame pointers for readable reports; the bits are the same (no
# fast-math, no contraction: every operation is the IEEE one at any -O).
SANITIZE = os.environ.get("TITAN_RL_SANITIZE") == "1"
if SANITIZE:
    CFLAGS = (*(f for f in CFLAGS if f != "-O3"), "-O1", "-g", "-fno-omit-frame-pointer",
              "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined")
    LDFLAGS = (*LDFLAGS, "-fsanitize=address,undefined")
_loaded = False


def build_dir() -> Path:
    env = os.environ.get("TITAN_RL_BUILD_DIR")
    root = Path(env) if env else _SRC.parents[1] / "build"
    d = root / (f"cpu_ext-torch{torch.__version__.replace('+', '_')}{'' if kind() == 'native' else '-' + kind()}"
                f"{'-sanitize' if SANITIZE else ''}")
    d.mkdir(parents=True, exist_ok=True)
    return d


def load(verbose: bool = False) -> None:
    """Compile (if needed) and load the extension; idempotent."""
    global _loaded
    if _loaded:
        return
    from torch.utils import cpp_extension

    # Fresh lists: cpp_extension.load appends torch's own link flags to extra_ldflags in
    # place, and the flags are part of the execution contract's source hash.
    cpp_extension.load(
        name="titan_rl_cpu", sources=[str(_SRC / s) for s in SOURCES], extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS), extra_include_paths=[str(_SRC)], build_directory=str(build_dir()), is_python_module=False,
        verbose=verbose,
    )
    _loaded = True


def ops():
    load()
    return torch.ops.titan_rl
