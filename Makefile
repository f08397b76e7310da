# make test    set up .venv (idempotent) and run the test suite (what CI runs)
# make parity  set up and run the main job: the parity harness, debug model, exact vs stock
# make bench   set up and run the overhead benchmark (small model)
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 2
export VLLM_ENABLE_V1_MULTIPROCESSING := 0

.PHONY: setup test parity bench
setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q

parity: setup
	$(PY) -m titan_rl.parity --config train_configs/debug.toml --engine both --json outputs/parity_debug.json

bench: setup
	$(PY) scripts/bench_parity_overhead.py --json outputs/bench_parity_overhead.json
