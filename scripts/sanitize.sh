#!/usr/bin/env bash
# The compiled CPU kernels under AddressSanitizer + UndefinedBehaviorSanitizer (`make sanitize`):
# a build of kernels/csrc with -fsanitize=address,undefined (TITAN_RL_SANITIZE=1, its own build
# folder: kernels/cpu_ext.py), then the tests that run those kernels, at 2 threads, with the
# sanitizers' runtimes preloaded into Python; on an AVX512 machine also the AVX2 machine's forms
# (TITAN_RL_CPU=avx2, kernels/cpu_features.py). Any report stops the run (halt_on_error).
# Run it after every change to kernels/csrc. Not in the suite: ~5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TESTS=(tests/test_kernels.py tests/test_attention_kernel.py tests/test_quant_gemm.py tests/test_gdn_kernels.py
       tests/test_tp_leaves.py tests/test_reduction.py tests/test_glm5_kernels.py tests/test_invariance_guard.py)
# glibc's own malloc thresholds: ASan replaces malloc, so these two measure nothing under it
SKIP=(--deselect tests/test_invariance_guard.py::test_glibc_keeps_freed_memory_unless_told_not_to
      --deselect tests/test_invariance_guard.py::test_glibc_keeps_more_than_a_gib_freed_at_once)
export TITAN_RL_SANITIZE=1 OMP_NUM_THREADS=2
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
preload="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
echo "[sanitize] building the kernels with -fsanitize=address,undefined"
$PY -m titan_rl.kernels.build >/dev/null 2>&1 || $PY -m titan_rl.kernels.build
echo "[sanitize] this CPU's forms"
LD_PRELOAD=$preload $PY -m pytest -q -p no:xdist -p no:cacheprovider "${TESTS[@]}" "${SKIP[@]}"
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  echo "[sanitize] the AVX2 machine's forms (TITAN_RL_CPU=avx2)"
  export TITAN_RL_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
  $PY -m titan_rl.kernels.build >/dev/null 2>&1 || $PY -m titan_rl.kernels.build
  LD_PRELOAD=$preload $PY -m pytest -q -p no:xdist -p no:cacheprovider tests/test_kernels.py tests/test_quant_gemm.py \
    tests/test_gdn_kernels.py tests/test_attention_kernel.py
fi
echo "[sanitize] clean"
