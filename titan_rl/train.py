"""The RL trainer: TorchTitan trains, vLLM (in-process, same model definition) samples.

    python -m titan_rl.train --config train_configs/rl_debug.toml [--run-dir DIR] [--section.key=value ...]
    torchrun --nproc_per_node=N -m titan_rl.train --config ... (FSDP over N ranks: the same global batch)
    python -m titan_rl.train --config ... --print-config

One step (RLTrainer.train_step, inside TorchTitan's Trainer.train loop, which owns the
step counter, DCP checkpoints, optimizer, LR schedule and metrics processor):
  1. rollout: this data-parallel rank's share of the step's `prompts_per_step` prompts (a
     pure function of seed and step; each completion's sampling seed one of its global
     index), `group_size` completions each, from the in-process vLLM engine; the
     sampler's log-probs are mu.
  2. rewards -> group-normalised advantages (GRPO).
  3. trainer forward at the rollout's weights -> pi; mismatch pi vs mu is measured here,
     before any update (so it is engine-vs-trainer, not policy lag).
  4. `updates_per_batch` optimizer steps on the PG loss (ratio uses mu).
  5. weight sync into the engine (prefix cache reset), a checksum proving both hold
     the same weights, and both sides' execution contracts compared (titan_rl.contract;
     also before the first rollout). Metrics: RUN_DIR/metrics.jsonl (one line per step).
The first `algorithm.sft_steps` steps are a supervised warm-up on the task's format.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from titan_rl import lifeline, quiet

# at import: engine processes started with "spawn" import this module first (as __mp_main__)
quiet.install()
if lifeline.started_by_a_trainer():  # before vLLM's start-up handshake: a killed trainer kills it
    lifeline.die_with_parent()


def main(argv=None) -> int:
    from titan_rl import config as config_mod
    from titan_rl import validation as v
    from titan_rl.errors import REPORTED, report_error
    from titan_rl.run_dir import latest_checkpoint_step

    ap = argparse.ArgumentParser(prog="python -m titan_rl.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="TOML file (default: the built-in debug config)")
    ap.add_argument("--run-dir", default=None, help="default: runs/<config name>")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    ap.add_argument("--allow-config-change", default="", metavar="KEY[,KEY...]",
                    help="resume a run dir whose stored config differs in these keys (logged in metrics.jsonl); "
                         "'platform': on other platform choices than it was trained on")
    args, overrides = ap.parse_known_args(argv)
    path = args.config or str(Path(__file__).resolve().parent.parent / "train_configs" / "rl_debug.toml")
    run_dir = args.run_dir or os.path.join("runs", Path(path).stem)
    allow = [k.strip() for k in args.allow_config_change.split(",") if k.strip()]
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        v.check_cli_overrides(overrides, [o for a in ap._actions for o in a.option_strings if o.startswith("--")])
        cfg = config_mod.load(path, overrides)
        if args.print_config:
            print(config_mod.to_toml(cfg))
            return 0
        task, changes = v.preflight_train(cfg, run_dir, allow)
        done = latest_checkpoint_step(cfg, run_dir) if cfg.checkpoint.enable else 0
        if done >= cfg.training.steps:
            if rank0:
                print(f"run dir {run_dir!r} has already finished: checkpoint at step {done} of "
                      f"training.steps = {cfg.training.steps}; nothing to do (raise training.steps with "
                      f"--allow-config-change=training.steps to continue it)", flush=True)
                from titan_rl.summary import summary_line

                line = summary_line(cfg, run_dir)
                if line:
                    print(line, flush=True)
            return 0
        if rank0:
            v.write_run_config(cfg, run_dir)
            v.write_run_platform(cfg, run_dir)
        return run(cfg, run_dir, task=task, config_changes=changes)
    except REPORTED as e:
        return report_error(e)


def run(cfg, run_dir: str, task=None, config_changes=None) -> int:
    """Train; `python -m titan_rl.train` has already run the start-up checks
    (titan_rl.validation) and passes the task they loaded and the allowed config changes."""
    import torch

    from titan_rl.launch import single_process_world
    from titan_rl.rl.trainer import RLTrainer
    from titan_rl.run_dir import keep_latest
    from titan_rl.summary import summary_line
    from titan_rl.titan.build import build_titan_config

    # A plain `python -m titan_rl.train` is a world of one: TorchTitan keeps its FSDP mesh at
    # size 1, so bf16 gets the same mixed-precision policy (fp32 masters) as under torchrun.
    single_process_world()
    os.makedirs(run_dir, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    t0 = time.perf_counter()
    trainer = RLTrainer(build_titan_config(cfg, run_dir), cfg, run_dir, task=task, config_changes=config_changes)
    try:
        trainer.train()
    finally:
        trainer.close()
    if trainer.ranks.rank == 0:
        keep_latest(cfg, run_dir)
        line = summary_line(cfg, run_dir, time.perf_counter() - t0)
        if line:
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
