"""The RL trainer's command line as tests/test_train.py and tests/test_train_runs.py run it:
short runs, one thread per process (the suite's two workers share 2 cores)."""

import os
import subprocess
import sys

SHORT = ["--training.steps=6", "--algorithm.sft_steps=2", "--algorithm.prompts_per_step=4",
         "--algorithm.group_size=4", "--algorithm.sft_batch=16", "--checkpoint.interval=2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
# bf16, RL from the first step: alone and under torchrun, the first step samples the same
# global batch
BF16_RL = ["--model.dtype=bfloat16", "--training.steps=3", "--lr_scheduler.warmup_steps=1", "--algorithm.sft_steps=0",
           "--algorithm.prompts_per_step=2", "--algorithm.group_size=4", "--checkpoint.enable=false"]


def train(run_dir, extra=(), timeout=300):
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_dir), *SHORT, *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
