"""What a run dir holds, read and written in one place: metrics.jsonl (one JSON line per
step), the DCP checkpoints TorchTitan writes (`<checkpoint.folder>/step-N`), and the
engine's weight folders. The stored config (config.toml) is titan_rl.validation's.

A relaunch after a crash resumes from the last checkpoint: `MetricsFile.resume` drops the
lines of steps that checkpoint has not reached, so the file ends up as an uninterrupted
run's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, METRICS_FILE)) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


# the weight sync's digests hash the slices each engine's layout holds (a TP-2 engine's differ
# from a TP-1 engine's): compared only between runs of one layout
_LAYOUT_DEPENDENT = ("weights_sha256_trainer", "weights_sha256_engine")


def comparable(m: dict, same_layout: bool = False) -> dict:
    """A metrics line without wall-clock and memory fields, nor where a relaunch resumed from
    (for resume- and layout-equality checks); without the layout-dependent weight digests
    unless both runs share one layout (`same_layout`)."""
    drop = ("resumed_from_step",) if same_layout else ("resumed_from_step", *_LAYOUT_DEPENDENT)
    return {k: v for k, v in m.items() if not k.endswith(("_seconds", "_per_s", "_mib")) and k not in drop}


class MetricsFile:
    """RUN_DIR/metrics.jsonl, written by rank 0 only (every rank holds the same line)."""

    def __init__(self, run_dir: str, rank: int):
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.rank = rank

    def resume(self, step: int) -> list[dict]:
        """Keep the lines of steps before `step` (the step a restored checkpoint resumes at);
        returns them."""
        if self.rank != 0 or not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            keep = [(ln, json.loads(ln)) for ln in f if ln.strip()]
        keep = [(ln, m) for ln, m in keep if m["step"] < step]
        with open(self.path, "w") as f:
            f.writelines(ln for ln, _ in keep)
        return [m for _, m in keep]

    def append(self, m: dict) -> None:
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(m) + "\n")


def console_line(m: dict, steps: int) -> str:
    """A step's line on the console (rank 0)."""
    if m["phase"] == "sft":
        return f"step {m['step']:4d}/{steps} sft  loss {m['loss']:.4f}"
    if m["phase"] == "eval":
        return (f"step {m['step']:4d}/{steps} eval accuracy {m['eval_accuracy']:.3f}  reward "
                f"{m['eval_reward_mean']:.3f}  len {m['eval_response_length']:.1f}  ({m['eval_n']} held-out "
                + (f"episodes, {m['eval_turns_per_episode']:.2f} turns each" if "eval_turns_per_episode" in m
                   else "questions")
                + (f", only {m['eval_distinct']} distinct" if m.get("eval_distinct", m["eval_n"]) < m["eval_n"] else "")
                + f", weights after step {m['weights_step']})")
    turns = f"  turns {m['turns_per_episode']:.2f}" if "turns_per_episode" in m else ""
    return (f"step {m['step']:4d}/{steps} rl   reward {m['reward_mean']:.3f}  len {m['response_length']:.1f}{turns}  "
            f"loss {m['loss']:+.4f}  max|dlogp| {m['max_abs_dlogp']:.3g}  bitwise {m['bitwise_fraction']:.3f}  "
            f"rollout {m['rollout_tokens_per_s']:.0f} tok/s")


def latest_checkpoint_step(cfg, run_dir: str) -> int:
    """The newest complete DCP checkpoint's step (DCP writes .metadata last), 0 if none."""
    folder = Path(run_dir) / cfg.checkpoint.folder
    steps = [0]
    if folder.is_dir():
        for d in folder.iterdir():
            if d.name.startswith("step-") and d.name[5:].isdigit() and (d / ".metadata").is_file():
                steps.append(int(d.name[5:]))
    return max(steps)


def keep_latest(cfg, run_dir: str) -> None:
    """TorchTitan saves the last step without purging, so keep_latest_k = k left k + 1
    checkpoints; drop the oldest (after close(), which joins TorchTitan's purge thread)."""
    k = cfg.checkpoint.keep_latest_k
    folder = os.path.join(run_dir, cfg.checkpoint.folder)
    if not cfg.checkpoint.enable or k == 0 or not os.path.isdir(folder):
        return
    steps = sorted(int(d[5:]) for d in os.listdir(folder) if d.startswith("step-") and d[5:].isdigit())
    for step in steps[:-k]:
        shutil.rmtree(os.path.join(folder, f"step-{step}"), ignore_errors=True)


def engine_folder(run_dir: str, rank: int) -> str:
    """Where a rank writes the weight folder its engine starts from."""
    return os.path.join(run_dir, f"engine_weights_rank{rank}")
