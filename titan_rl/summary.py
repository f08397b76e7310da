"""The one line a finished run ends with, computed from RUN_DIR/metrics.jsonl (so a run
resumed after a crash summarises all its steps, not only this process's)."""

from __future__ import annotations

import os

from titan_rl.run_dir import METRICS_FILE, read_metrics


def summary_line(cfg, run_dir: str, seconds: float | None = None) -> str | None:
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return None
    ms = read_metrics(run_dir)
    if not ms:
        return None
    rl = [m for m in ms if m.get("phase") == "rl"]
    sft = [m for m in ms if m.get("phase") == "sft"]
    parts = [f"done: {ms[-1]['step']} steps ({len(sft)} sft + {len(rl)} rl)"
             + (f" in {int(seconds // 60)}m{int(seconds % 60):02d}s" if seconds is not None else "")]
    rewards = [m["reward_mean"] for m in rl if "reward_mean" in m]
    if rewards:
        n = min(10, len(rewards))
        first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
        parts.append(f"reward {first:.2f} (first {n} rl) -> {last:.2f} (last {n})")
    evals = [m for m in ms if m.get("phase") == "eval" and "eval_accuracy" in m]
    if evals:
        first, last = evals[0], evals[-1]
        parts.append(f"held-out accuracy {first['eval_accuracy']:.2f} (weights of step {first['weights_step']}) -> "
                     f"{last['eval_accuracy']:.2f} (step {last['weights_step']})")
    dl = [m["max_abs_dlogp"] for m in rl if "max_abs_dlogp" in m]
    if dl:
        parts.append(f"max |dlogp| {max(dl):.3g} over {len(dl)} rl steps")
    turns = [m["turns_per_episode"] for m in rl if "turns_per_episode" in m]
    if turns:  # multi-turn episodes (titan_rl.rl.episodes)
        parts.append(f"{sum(turns) / len(turns):.2f} turns per episode, render breaks "
                     f"{sum(m.get('render_breaks', 0) for m in rl)}, re-render divergence "
                     f"{sum(m.get('rerender_divergence', 0) for m in rl)} episodes, mixed-version tokens "
                     f"{sum(m.get('mixed_version_tokens', 0) for m in rl)}, environment errors "
                     f"{sum(m.get('env_errors', 0) for m in rl)}")
    phases = [(name, [m[f"time_{key}_seconds"] for m in rl if f"time_{key}_seconds" in m])
              for name, key in (("rollout", "rollout"), ("forward", "forward"), ("backward", "backward"),
                                ("optimizer", "optimizer"), ("sync", "weight_sync"))]
    if turns:  # part of the rollout's time: the environments' own calls
        phases.insert(1, ("of which environments", [m.get("time_env_seconds", 0.0) for m in rl]))
    if rl and all(v for _, v in phases):
        step_s = [m["step_seconds"] for m in rl if "step_seconds" in m]
        parts.append(f"s per rl step {sum(step_s) / len(step_s):.1f} (" + ", ".join(
            f"{name} {sum(v) / len(v):.1f}" for name, v in phases) + ")")
    rss = [m["peak_rss_mib"] for m in ms if "peak_rss_mib" in m]
    if rss:
        parts.append(f"peak RSS {max(rss) / 1024:.1f} GiB")
    skipped = sum(1 for m in ms if m.get("skipped_nonfinite"))
    if skipped:
        parts.append(f"{skipped} steps skipped (non-finite loss or grad norm)")
    ckpt = os.path.join(run_dir, cfg.checkpoint.folder)
    parts.append(f"metrics {path}" + (f", checkpoints {ckpt}" if cfg.checkpoint.enable else ""))
    return "; ".join(parts)
