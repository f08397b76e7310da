"""Quantized rollouts, two ways: what a normal stack runs (vLLM's own online FP8 samples,
a bf16 plain-torch trainer scores) beside the unified flow (the engine holds the same
fp8_rowwise weights the trainer fake-quantizes; mismatch 0). Same task, seeds, schedule
and dtype; one seed each (the curves are single runs, not averages).

    python scripts/experiment_quant.py [--steps 160] [--sft-steps 60] [--nproc 1] [--json OUT] [--html OUT]

stock_fp8: kernels = "stock" + quantization.recipe = "fp8_rowwise": vLLM's built-in Qwen3
           with its torchao FP8 weight-only quantization (vLLM's quantization="fp8" does
           not run on its CPU build: docs/quantization.md), a plain torch bf16 trainer.
unified:   kernels = "exact" + the same recipe: fp8 weights and activations on both sides.
Writes the per-step reward and mismatch of both runs as JSON and the curves side by side
as one self-contained HTML page (SVG). scripts/experiment_mismatch.py is the bf16 pattern
this follows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from titan_rl import quiet

quiet.install()  # before torch, torchao and TorchTitan load

from titan_rl.charts import line_chart  # noqa: E402
from titan_rl.jsonout import write_json  # noqa: E402
from titan_rl.report import page, table  # noqa: E402
from titan_rl.rl.trainer import read_metrics  # noqa: E402

from experiment_mismatch import _port, summary  # noqa: E402  (scripts/ is this script's path)

MODES = {
    "stock_fp8": ["--model.kernels=stock"],
    "unified": ["--model.kernels=exact"],
}
CURVE_KEYS = ("step", "reward_mean", "max_abs_dlogp", "mean_abs_dlogp", "bitwise_fraction")


def run(mode: str, run_dir: str, args) -> list[dict]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, f"--nproc_per_node={args.nproc}", f"--master_port={_port()}", "-m", "titan_rl.train",
           "--config", args.config, "--run-dir", run_dir, f"--model.dtype={args.dtype}",
           f"--training.steps={args.steps}", f"--algorithm.sft_steps={args.sft_steps}",
           f"--quantization.recipe={args.recipe}", "--checkpoint.enable=false", *MODES[mode]]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.nproc)))
    print(f"[{mode}] {' '.join(cmd[1:])}", flush=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return [m for m in read_metrics(run_dir) if m["phase"] == "rl"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="train_configs/rl_debug.toml")
    ap.add_argument("--recipe", default="fp8_rowwise", choices=["fp8_rowwise"],
                    help="the recipe both runs use (the stock engine has an online form of this one only)")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", default="outputs/experiment_quant.json")
    ap.add_argument("--html", default="outputs/experiment_quant.html")
    args = ap.parse_args(argv)
    curves = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in MODES:
            curves[mode] = run(mode, os.path.join(d, mode), args)
    doc = {"args": vars(args), "seeds": "one seed per mode (training.seed of the config)",
           "summary": {m: summary(rl) for m, rl in curves.items()},
           "curves": {m: [{k: x[k] for k in CURVE_KEYS} for x in rl] for m, rl in curves.items()}}
    keys = [k for k in doc["summary"]["unified"] if k != "tis_clipped_fraction_mean"]
    print(f"\n{'':26s}" + "".join(f"{m:>14s}" for m in MODES))
    for k in keys:
        print(f"{k:26s}" + "".join(f"{doc['summary'][m][k]:>14.4g}" for m in MODES))
    write_json(args.json, doc)
    body = [
        "<p>One seed per mode: single runs, not averages.</p>",
        "<h2>Reward per RL step</h2>",
        line_chart([(m, [(x["step"], x["reward_mean"]) for x in rl]) for m, rl in curves.items()],
                   f"Mean reward: stock FP8 rollouts + bf16 trainer vs unified {args.recipe}", "step", "reward_mean"),
        line_chart([(m, [(x["step"], x["mean_abs_dlogp"]) for x in rl]) for m, rl in curves.items()],
                   "Mean |pi - mu| per step", "step", "mean |log ratio|", log=True, zero_means_equal=True),
        "<h2>Summary</h2>",
        table(["quantity", *MODES], [[k, *[f"{doc['summary'][m][k]:.4g}" for m in MODES]] for k in keys]),
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.html)), exist_ok=True)
    with open(args.html, "w") as f:
        f.write(page(f"Quantized rollouts: stock FP8 vs unified {args.recipe}", args.config, body))
    print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
