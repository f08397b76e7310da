# make train   set up .venv (idempotent) and run the main job: a short RL run (debug model, built-in task)
# make test    set up .venv (idempotent) and run the test suite (what CI runs)
# make parity  set up and run the parity harness, debug model, exact vs stock
# make bench   set up and run the overhead benchmark (small model)
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 2
export VLLM_ENABLE_V1_MULTIPROCESSING := 0

.PHONY: setup train test parity bench
setup:
	@bash scripts/setup.sh

train: setup
	$(PY) -m titan_rl.train --config train_configs/rl_debug.toml --run-dir runs/rl_debug

test: setup
	$(PY) -m pytest -q

parity: setup
	$(PY) -m titan_rl.parity --config train_configs/debug.toml --kernels both --json outputs/parity_debug.json

bench: setup
	$(PY) scripts/bench_parity_overhead.py --json outputs/bench_parity_overhead.json
