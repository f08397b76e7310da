"""Where an RL step's time goes: rollout, scoring (trainer forward), backward,
optimizer, weight sync, for the debug and small flavors (single process, CPU).

    python scripts/bench_step.py [--flavors debug,small] [--steps 6] [--recipe none] [--json OUT]

Runs the real trainer (`python -m titan_rl.train`) per flavor in a subprocess with a
short schedule (1 SFT step, then RL), reads RUN_DIR/metrics.jsonl and averages the
per-phase timings over the RL steps after the first (which includes warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from titan_rl.jsonout import write_json

PHASES = ("rollout", "forward", "backward", "optimizer", "weight_sync")


def run_flavor(flavor: str, steps: int, prompts: int, group: int, recipe: str = "none") -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", d, f"--model.flavor={flavor}",
               f"--training.steps={steps}", "--lr_scheduler.warmup_steps=1", "--algorithm.sft_steps=1", f"--algorithm.prompts_per_step={prompts}",
               f"--algorithm.group_size={group}", "--checkpoint.enable=false", f"--quantization.recipe={recipe}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{flavor}: trainer failed\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        with open(os.path.join(d, "metrics.jsonl")) as f:
            rl = [json.loads(ln) for ln in f if ln.strip() and json.loads(ln)["phase"] == "rl"][1:]
    out = {p: sum(m[f"time_{p}_seconds"] for m in rl) / len(rl) for p in PHASES}
    out["step"] = sum(m["step_seconds"] for m in rl) / len(rl)
    out["other"] = out["step"] - sum(out[p] for p in PHASES)
    out["max_abs_dlogp"] = max(m["max_abs_dlogp"] for m in rl)
    out["rl_steps_averaged"] = len(rl)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flavors", default="debug,small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--recipe", default="none", help="[quantization] recipe of the runs (docs/quantization.md)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = {f: run_flavor(f, args.steps, args.prompts, args.group, args.recipe) for f in args.flavors.split(",")}
    cols = [*PHASES, "other", "step"]
    print(f"\n{'flavor':8s}" + "".join(f"{c:>13s}" for c in cols) + f"{'max|dlogp|':>12s}")
    for f, r in res.items():
        print(f"{f:8s}" + "".join(f"{r[c]:>12.3f}s" for c in cols) + f"{r['max_abs_dlogp']:>12.3g}")
        print(f"{'':8s}" + "".join(f"{100 * r[c] / r['step']:>12.1f}%" for c in cols))
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
