"""What layout-invariant gradients cost: step time at FSDP = 2 with deterministic reduction
(gradient leaves + the fixed tree, titan_rl.titan.leaf_reduction) vs FSDP2's own
reduce-scatter, side by side in one run.

    python scripts/bench_layout.py [--steps 8] [--sft-steps 4] [--json OUT]

Runs the real trainer under `torchrun --nproc_per_node=2` twice with the same short
schedule (SFT steps, then RL), `parallelism.deterministic_reduction` true and false, reads
each RUN_DIR/metrics.jsonl and averages the step times per phase over the SFT steps and
the RL steps after the first of each (which include warm-up).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from titan_rl.jsonout import write_json
from titan_rl.launch import free_port
from titan_rl.run_dir import read_metrics

RL_PHASES = ("forward", "backward", "optimizer", "rollout", "weight_sync")
MODES = {"deterministic": "true", "plain": "false"}


def run_mode(flag: str, args) -> dict:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with tempfile.TemporaryDirectory() as d:
        cmd = [torchrun, "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "titan_rl.train", "--run-dir", d,
               f"--model.dtype={args.dtype}", f"--parallelism.deterministic_reduction={flag}",
               f"--training.steps={args.steps}", "--lr_scheduler.warmup_steps=1",
               f"--algorithm.sft_steps={args.sft_steps}", f"--algorithm.sft_batch={args.sft_batch}",
               f"--algorithm.prompts_per_step={args.prompts}", f"--algorithm.group_size={args.group}",
               "--checkpoint.enable=false"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(f"deterministic_reduction = {flag}: trainer failed\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        lines = read_metrics(d)
    sft = [m for m in lines if m["phase"] == "sft"][1:]
    rl = [m for m in lines if m["phase"] == "rl"][1:]
    if not sft or not rl:
        raise SystemExit("need at least 2 SFT and 2 RL steps (--sft-steps, --steps)")
    out = {"sft_step": sum(m["step_seconds"] for m in sft) / len(sft),
           "rl_step": sum(m["step_seconds"] for m in rl) / len(rl)}
    out.update({f"rl_{p}": sum(m[f"time_{p}_seconds"] for m in rl) / len(rl) for p in RL_PHASES})
    out["sft_steps_averaged"], out["rl_steps_averaged"] = len(sft), len(rl)
    out["max_abs_dlogp"] = max(m["max_abs_dlogp"] for m in rl)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=4)
    ap.add_argument("--sft-batch", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = {mode: run_mode(flag, args) for mode, flag in MODES.items()}
    cols = ["sft_step", "rl_step", *(f"rl_{p}" for p in RL_PHASES)]
    ratio = {c: res["deterministic"][c] / res["plain"][c] for c in cols}
    print(f"\nFSDP = 2 ({args.dtype}, debug model), seconds per step")
    print(f"{'':15s}" + "".join(f"{c:>15s}" for c in cols))
    for mode in MODES:
        print(f"{mode:15s}" + "".join(f"{res[mode][c]:>14.3f}s" for c in cols))
    print(f"{'ratio det/plain':15s}" + "".join(f"{ratio[c]:>14.2f}x" for c in cols))
    if args.json:
        write_json(args.json, {**res, "sft_ratio": ratio["sft_step"], "rl_ratio": ratio["rl_step"],
                               "ratio_deterministic_over_plain": ratio, "settings": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
