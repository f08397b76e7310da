"""Every Triton kernel of the GPU path compiles for an H200 (sm_90 cubin) and its PTX holds no
TF32 instruction, no GPU needed (what the compiler shows that the interpreter cannot:
kernels/compile_check.py). Skipped where this triton has no CUDA backend or runs as the
interpreter.
"""

import os

import pytest

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the Triton interpreter replaces the compiler in this process", allow_module_level=True)

from titan_rl.kernels.compile_check import TF32_MESSAGE, NoCudaBackend, compile_sm90, kernel_id, kernels  # noqa: E402

KERNELS = kernels()


@pytest.mark.parametrize("fn, pointers, constexprs", KERNELS, ids=[kernel_id(k[0], k[1]) for k in KERNELS])
def test_kernel_compiles_for_sm90(fn, pointers, constexprs):
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        pytest.skip("the kernel modules were imported under the Triton interpreter in this process")
    try:
        compiled = compile_sm90(fn, pointers, constexprs)
    except NoCudaBackend as e:
        pytest.skip(f"no CUDA backend in this triton: {e}")
    assert compiled.asm["cubin"]
    # the TF32 trap: an fp32 tl.dot without input_precision="ieee" compiles to TF32 MMAs
    # (10-bit mantissa); every dot here is meant to be exact in its operands' precision
    assert "tf32" not in compiled.asm["ptx"], TF32_MESSAGE


def test_the_gpu_checks_compiler_rows_are_these():
    """scripts/gpu_check.py's (a') rows come from the same table, in its own child process
    (the GPU image's bare checkout): one row per kernel, each "ok"."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(script), "--compile-only"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    if set(rows.values()) == {"no cuda backend"}:
        pytest.skip("no CUDA backend in this triton")
    assert rows == {kernel_id(fn, p): "ok" for fn, p, _ in KERNELS}
