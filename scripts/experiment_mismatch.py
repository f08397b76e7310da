"""The counterfactual: the same RL run with a mismatched stack corrected by TIS, and
with titan_rl's exact stack. Same task, seeds, schedule and dtype; only the kernels differ.

    python scripts/experiment_mismatch.py [--steps 160] [--sft-steps 60] [--nproc 2] [--json OUT] [--html OUT]

stock_tis: vLLM's built-in Qwen3 samples, a plain torch trainer scores (bf16 under FSDP),
           token-level truncated importance sampling (cap 2) corrects the residual.
exact:     our registered model in vLLM and the same kernels in the trainer (mismatch 0).
Writes the per-step reward and mismatch of both runs as JSON and the curves side by
side as one self-contained HTML page (SVG).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile

from titan_rl import quiet

quiet.install()  # before torch, torchao and TorchTitan load

from titan_rl.charts import line_chart
from titan_rl.jsonout import write_json
from titan_rl.report import page, table
from titan_rl.rl.trainer import read_metrics

MODES = {
    "stock_tis": ["--model.kernels=stock", "--correction.tis_cap=2.0"],
    "exact": ["--model.kernels=exact"],
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, run_dir: str, args) -> list[dict]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, f"--nproc_per_node={args.nproc}", f"--master_port={_port()}", "-m", "titan_rl.train",
           "--config", args.config, "--run-dir", run_dir, f"--model.dtype={args.dtype}",
           f"--training.steps={args.steps}", f"--algorithm.sft_steps={args.sft_steps}",
           "--checkpoint.enable=false", *MODES[mode]]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.nproc)))
    print(f"[{mode}] {' '.join(cmd[1:])}", flush=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return [m for m in read_metrics(run_dir) if m["phase"] == "rl"]


def summary(rl: list[dict]) -> dict:
    rewards = [m["reward_mean"] for m in rl]
    return {
        "rl_steps": len(rl),
        "reward_first10": statistics.mean(rewards[:10]),
        "reward_last10": statistics.mean(rewards[-10:]),
        "max_abs_dlogp_max": max(m["max_abs_dlogp"] for m in rl),
        "mean_abs_dlogp_mean": statistics.mean(m["mean_abs_dlogp"] for m in rl),
        "bitwise_fraction_mean": statistics.mean(m["bitwise_fraction"] for m in rl),
        "tis_clipped_fraction_mean": statistics.mean(m.get("tis_clipped_fraction", 0.0) for m in rl),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="train_configs/rl_debug.toml")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", default="outputs/experiment_mismatch.json")
    ap.add_argument("--html", default="outputs/experiment_mismatch.html")
    args = ap.parse_args(argv)
    curves = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in MODES:
            curves[mode] = run(mode, os.path.join(d, mode), args)
    doc = {"args": vars(args), "summary": {m: summary(rl) for m, rl in curves.items()},
           "curves": {m: [{k: x[k] for k in ("step", "reward_mean", "max_abs_dlogp", "mean_abs_dlogp",
                                              "bitwise_fraction")} for x in rl] for m, rl in curves.items()}}
    keys = list(doc["summary"]["exact"])
    print(f"\n{'':26s}" + "".join(f"{m:>14s}" for m in MODES))
    for k in keys:
        print(f"{k:26s}" + "".join(f"{doc['summary'][m][k]:>14.4g}" for m in MODES))
    write_json(args.json, doc)
    body = [
        "<h2>Reward per RL step</h2>",
        line_chart([(m, [(x["step"], x["reward_mean"]) for x in rl]) for m, rl in curves.items()],
                   "Mean reward: stock + TIS vs exact", "step", "reward_mean"),
        line_chart([(m, [(x["step"], x["mean_abs_dlogp"]) for x in rl]) for m, rl in curves.items()],
                   "Mean |pi - mu| per step", "step", "mean |log ratio|", log=True, zero_means_equal=True),
        "<h2>Summary</h2>",
        table(["quantity", *MODES], [[k, *[f"{doc['summary'][m][k]:.4g}" for m in MODES]] for k in keys]),
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.html)), exist_ok=True)
    with open(args.html, "w") as f:
        f.write(page("Mismatch counterfactual: stock + TIS vs exact", args.config, body))
    print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
