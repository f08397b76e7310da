"""The same RL run under two stacks, side by side: same task, seeds, schedule and dtype; only
the modes' flags differ. One seed per mode (the curves are single runs, not averages).

    python scripts/experiment_rl.py mismatch [--steps 160] [--sft-steps 60] [--nproc N] [--json OUT] [--html OUT]
    python scripts/experiment_rl.py quant    [...]

mismatch   stock_tis: vLLM's built-in Qwen3 samples, a plain torch trainer scores (bf16 under
           FSDP), token-level truncated importance sampling (cap 2) corrects the residual;
           exact: our registered model in vLLM and the same kernels in the trainer (mismatch 0).
quant      stock_fp8: kernels = "stock" + quantization.recipe = "fp8_rowwise": vLLM's built-in
           Qwen3 with its torchao FP8 weight-only quantization (vLLM's quantization="fp8" does
           not run on its CPU build: docs/quantization.md), a plain torch bf16 trainer;
           unified: kernels = "exact" + the same recipe, fp8 weights and activations on both sides.
Writes the per-step reward and mismatch of both runs as JSON and the curves side by side as one
self-contained HTML page (SVG).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from titan_rl import quiet

quiet.install()  # before torch, torchao and TorchTitan load

from titan_rl.charts import line_chart  # noqa: E402
from titan_rl.jsonout import write_json  # noqa: E402
from titan_rl.launch import free_port  # noqa: E402
from titan_rl.report import page, table  # noqa: E402
from titan_rl.run_dir import read_metrics  # noqa: E402

CURVE_KEYS = ("step", "reward_mean", "max_abs_dlogp", "mean_abs_dlogp", "bitwise_fraction")


@dataclass(frozen=True)
class Experiment:
    modes: dict[str, list[str]]  # mode -> its flags (the rest of the command is shared)
    flags: tuple[str, ...]       # flags of both runs
    nproc: int                   # default torchrun ranks
    title: str


EXPERIMENTS = {
    "mismatch": Experiment(modes={"stock_tis": ["--model.kernels=stock", "--correction.tis_cap=2.0"],
                                  "exact": ["--model.kernels=exact"]},
                           flags=(), nproc=2, title="Mismatch counterfactual: stock + TIS vs exact"),
    "quant": Experiment(modes={"stock_fp8": ["--model.kernels=stock"], "unified": ["--model.kernels=exact"]},
                        flags=("--quantization.recipe=fp8_rowwise",), nproc=1,
                        title="Quantized rollouts: stock FP8 rollouts + bf16 trainer vs unified fp8_rowwise"),
}


def run(exp: Experiment, mode: str, run_dir: str, args) -> list[dict]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, f"--nproc_per_node={args.nproc}", f"--master_port={free_port()}", "-m", "titan_rl.train",
           "--config", args.config, "--run-dir", run_dir, f"--model.dtype={args.dtype}",
           f"--training.steps={args.steps}", f"--algorithm.sft_steps={args.sft_steps}",
           "--checkpoint.enable=false", *exp.flags, *exp.modes[mode]]
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
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS))
    ap.add_argument("--config", default="train_configs/rl_debug.toml")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--nproc", type=int, default=None, help="torchrun ranks (default: mismatch 2, quant 1)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", default=None, help="default: outputs/experiment_<experiment>.json")
    ap.add_argument("--html", default=None, help="default: outputs/experiment_<experiment>.html")
    args = ap.parse_args(argv)
    exp = EXPERIMENTS[args.experiment]
    args.nproc = args.nproc or exp.nproc
    args.json = args.json or f"outputs/experiment_{args.experiment}.json"
    args.html = args.html or f"outputs/experiment_{args.experiment}.html"
    curves = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in exp.modes:
            curves[mode] = run(exp, mode, os.path.join(d, mode), args)
    doc = {"args": vars(args), "seeds": "one seed per mode (training.seed of the config)",
           "summary": {m: summary(rl) for m, rl in curves.items()},
           "curves": {m: [{k: x[k] for k in CURVE_KEYS} for x in rl] for m, rl in curves.items()}}
    keys = list(next(iter(doc["summary"].values())))
    print(f"\n{'':26s}" + "".join(f"{m:>14s}" for m in exp.modes))
    for k in keys:
        print(f"{k:26s}" + "".join(f"{doc['summary'][m][k]:>14.4g}" for m in exp.modes))
    write_json(args.json, doc)
    body = [
        "<p>One seed per mode: single runs, not averages.</p>",
        "<h2>Reward per RL step</h2>",
        line_chart([(m, [(x["step"], x["reward_mean"]) for x in rl]) for m, rl in curves.items()],
                   "Mean reward", "step", "reward_mean"),
        line_chart([(m, [(x["step"], x["mean_abs_dlogp"]) for x in rl]) for m, rl in curves.items()],
                   "Mean |pi - mu| per step", "step", "mean |log ratio|", log=True, zero_means_equal=True),
        "<h2>Summary</h2>",
        table(["quantity", *exp.modes], [[k, *[f"{doc['summary'][m][k]:.4g}" for m in exp.modes]] for k in keys]),
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.html)), exist_ok=True)
    with open(args.html, "w") as f:
        f.write(page(exp.title, args.config, body))
    print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
