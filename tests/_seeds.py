"""The one place tests draw random seeds.

Exact tests draw a fresh seed per run (an exactness claim must hold for any input);
tolerance tests draw one too, so their bounds must hold for any seed. Both print it.

  TITAN_RL_TEST_SEED=S   every draw returns S (reproduce a failure)
  TITAN_RL_SEEDS=N       tests taking the `seed` / `rng` fixtures run N times, each with a
                         fresh seed (a sweep: `TITAN_RL_SEEDS=300 pytest tests/test_kernels.py`)
"""

import os


def draw_seed(what: str = "seed") -> int:
    fixed = os.environ.get("TITAN_RL_TEST_SEED")
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    print(f"{what}={seed}")
    return seed


def sweep_size() -> int:
    return max(1, int(os.environ.get("TITAN_RL_SEEDS", "1")))
