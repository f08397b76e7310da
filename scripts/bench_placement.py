"""What separate engine processes cost and buy: RL step time with the engine colocated
(in-process, synchronous), separate and synchronous (max_off_policy_steps = 0) and separate
one step ahead (max_off_policy_steps = 1), side by side in one run; the weight transfer's
bytes and seconds; the policy lag and the two mismatch columns (against the behaviour
weights, and the current weights' movement away from them).

    python scripts/bench_placement.py [--steps 12] [--sft-steps 2] [--json OUT]

Each mode runs `python -m titan_rl.train` on train_configs/rl_debug.toml with the same short
schedule; step times are averaged over the RL steps after the first (which includes the
engine's start).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from titan_rl.jsonout import write_json
from titan_rl.run_dir import read_metrics

MODES = {
    "colocated": [],
    "separate K=0": ["--rollout.placement=separate"],
    "separate K=1": ["--rollout.placement=separate", "--rollout.max_off_policy_steps=1"],
}


def run_mode(extra: list[str], args, work: str, name: str) -> dict:
    run_dir = os.path.join(work, name.replace(" ", "_").replace("=", ""))
    cmd = [sys.executable, "-m", "titan_rl.train", "--config", "train_configs/rl_debug.toml", "--run-dir", run_dir,
           f"--training.steps={args.steps}", f"--algorithm.sft_steps={args.sft_steps}", "--checkpoint.enable=false",
           *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(f"{name} failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    rl = [m for m in read_metrics(run_dir) if m["phase"] == "rl"]
    timed = rl[1:] or rl
    def mean(key: str) -> float:
        return statistics.fmean(m[key] for m in timed)

    return {
        "rl_steps": len(rl),
        "step_seconds": mean("step_seconds"),
        "rollout_seconds": mean("time_rollout_seconds"),
        "weight_sync_seconds": mean("time_weight_sync_seconds"),
        "weight_sync_bytes": rl[-1]["weight_sync_bytes"],
        "policy_lag_max": max(m["policy_lag"] for m in rl),
        "max_abs_dlogp": max(m["max_abs_dlogp"] for m in rl),
        "lag_abs_dlogp_max": max(m["lag_abs_dlogp"] for m in rl),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--sft-steps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as work:
        for name, extra in MODES.items():
            print(f"[{name}] {args.steps} steps ...", flush=True)
            out[name] = run_mode(extra, args, work, name)
    base = out["colocated"]["step_seconds"]
    for r in out.values():
        r["step_vs_colocated"] = r["step_seconds"] / base
    print(f"\n{'mode':14} {'step s':>8} {'vs coloc':>9} {'rollout s':>10} {'sync s':>8} {'sync MB':>8} "
          f"{'lag':>4} {'max|dlogp|':>11} {'lag|dlogp|':>11}")
    for name, r in out.items():
        print(f"{name:14} {r['step_seconds']:8.3f} {r['step_vs_colocated']:8.2f}x {r['rollout_seconds']:10.3f} "
              f"{r['weight_sync_seconds']:8.3f} {r['weight_sync_bytes'] / 2**20:8.1f} {r['policy_lag_max']:4d} "
              f"{r['max_abs_dlogp']:11.3g} {r['lag_abs_dlogp_max']:11.3g}")
    if args.json:
        write_json(args.json, {"steps": args.steps, "sft_steps": args.sft_steps, "threads":
                               os.environ.get("OMP_NUM_THREADS"), "modes": out})
    return 0


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
