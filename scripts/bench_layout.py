"""What layout-invariant gradients cost: step time at FSDP = 2 with deterministic reduction
(gradient leaves + the fixed tree, titan_rl.titan.leaf_reduction) vs FSDP2's own
reduce-scatter, side by side in one invocation.

    python scripts/bench_layout.py [--repeats 2] [--steps 80] [--sft-steps 40] [--json OUT]
    python scripts/bench_layout.py --separate-runs [--repeats 3] [--steps 16] [--sft-steps 8]

Default (alternating steps): each repeat is one run of the real trainer under `torchrun
--nproc_per_node=2` (OMP_NUM_THREADS = 1), SFT steps then RL, whose steps ALTERNATE between
the two modes: the trainer is built with `parallelism.deterministic_reduction = true`, and
before every other step the batch plan (titan_rl.rl.batch_plan: LeafTree / Collective) and
every FSDP unit's reduce-scatter (the leaf tree's / FSDP2's DefaultReduceScatter) are
swapped, so that step runs exactly what a `deterministic_reduction = false` run runs. Two
adjacent steps see nearly the same load of the shared machine, which separate runs a
minute apart do not (their ratios moved by 0.6x-1.7x at load 3-6 on 2 cores). Repeats
alternate which mode takes the odd steps. The first pair of each phase is left out
(warm-up: the first RL step includes the engine's compile).

Figures, stated in the output: for each (det, plain) pair of adjacent steps the ratio of
their step times; `sft_ratio` and `rl_ratio` are the MEDIAN of those ratios over all pairs
of all repeats, with a 90% bootstrap interval of that median (at load 4-9 on 2 cores one
pair's ratio ranged 0.5-2.6; 38 pairs per phase by default). Beside them: each mode's
median and minimum step time, the ratio of the minima, the load average before each
repeat, and `cpu_sft_ratio` / `cpu_rl_ratio`: the same median of pair ratios for the CPU
seconds a step took in all threads of both ranks (time not spent running, waiting for the
other rank or descheduled by other jobs, does not count; so it shows the work the
deterministic step adds, with less of the load's noise). With deterministic reduction on
both sides (an A/A run) the wall-clock ratios came out 1.00x / 0.93x: that is the noise floor.

--separate-runs: each mode in its own torchrun (`deterministic_reduction` true / false),
repeats alternating which goes first; the ratio is the median over repeats of (det median
step / plain median step) of the repeat's two runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

RL_PHASES = ("forward", "backward", "optimizer", "rollout", "weight_sync")
MODES = {"deterministic": "true", "plain": "false"}
COLS = ("sft_step", "rl_step", *(f"rl_{p}" for p in RL_PHASES))
CPU_COLS = ("sft_cpu", "rl_cpu")  # alternating runs only: the step's CPU seconds, both ranks summed


# -- inside torchrun: the alternating trainer ----------------------------------------------

def install_alternation(first: str) -> None:
    """Make RLTrainer.train_step swap the plan and the FSDP units' reduce-scatter before each
    step: steps 1, 3, ... run `first`, 2, 4, ... the other mode (self._bench_mode). Each
    metrics line gets "bench_mode" and "bench_cpu_seconds": the CPU time the step took in
    all threads of both ranks (time.process_time; descheduled time does not count, so it
    moves far less with the shared machine's load than the wall clock)."""
    import time

    import torch
    import torch.distributed as dist

    from titan_rl.titan import cpu_compat  # noqa: F401  (before torchtitan)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    from titan_rl.rl import trainer as trainer_mod
    from titan_rl.rl.batch_plan import Collective, LeafTree

    order = [first, next(m for m in MODES if m != first)]
    T = trainer_mod.RLTrainer
    step_fn, log_fn = T.train_step, T._log

    def train_step(self, data_iterator):
        if not hasattr(self, "_bench_modes"):
            if not isinstance(self.plan, LeafTree):
                raise SystemExit("the alternating bench needs parallelism.deterministic_reduction = true")
            groups = [g for m in self.model.modules() if isinstance(m, FSDPModule)
                      for g in m._get_fsdp_state()._fsdp_param_groups]
            self._bench_groups = groups
            self._bench_modes = {"deterministic": (self.plan, [g._reduce_scatter_comm for g in groups]),
                                 "plain": (Collective(self.ranks), [DefaultReduceScatter() for _ in groups])}
        self._bench_mode = order[(self.step - 1) % 2]
        self.plan, comms = self._bench_modes[self._bench_mode]
        for g, comm in zip(self._bench_groups, comms):
            g._reduce_scatter_comm = comm
        self._bench_cpu = time.process_time()
        return step_fn(self, data_iterator)

    def log(self, m):  # every rank calls it, after the step's clock stopped
        cpu = torch.tensor([time.process_time() - self._bench_cpu], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(cpu)
        m["bench_mode"], m["bench_cpu_seconds"] = self._bench_mode, float(cpu)
        return log_fn(self, m)

    T.train_step, T._log = train_step, log


def _alternating_worker(first: str, train_args: list[str]) -> int:
    from titan_rl.train import main

    install_alternation(first)
    return main(train_args)


# -- the parent ------------------------------------------------------------------------------

def _train_args(run_dir: str, flag: str, args) -> list[str]:
    return ["--run-dir", run_dir, f"--model.dtype={args.dtype}", f"--parallelism.deterministic_reduction={flag}",
            f"--training.steps={args.steps}", "--lr_scheduler.warmup_steps=1",
            f"--algorithm.sft_steps={args.sft_steps}", f"--algorithm.sft_batch={args.sft_batch}",
            f"--algorithm.prompts_per_step={args.prompts}", f"--algorithm.group_size={args.group}",
            "--checkpoint.enable=false"]


def _torchrun(what: list[str], run_dir: str, flag: str, args) -> list[dict]:
    from titan_rl.launch import free_port
    from titan_rl.run_dir import read_metrics

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node=2", f"--master_port={free_port()}", *what, *_train_args(run_dir, flag, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(what)} (deterministic_reduction = {flag}): trainer failed\n"
                         f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return read_metrics(run_dir)


def _columns(lines: list[dict]) -> dict[str, list[float]]:
    sft = [m for m in lines if m["phase"] == "sft"]
    rl = [m for m in lines if m["phase"] == "rl"]
    out = {"sft_step": [m["step_seconds"] for m in sft], "rl_step": [m["step_seconds"] for m in rl]}
    out.update({f"rl_{p}": [m[f"time_{p}_seconds"] for m in rl] for p in RL_PHASES})
    if all("bench_cpu_seconds" in m for m in lines):
        out["sft_cpu"], out["rl_cpu"] = [m["bench_cpu_seconds"] for m in sft], [m["bench_cpu_seconds"] for m in rl]
    return out


def run_alternating(first: str, args) -> tuple[dict, dict]:
    """One run whose steps alternate the modes. Returns (each mode's per-step columns, the
    per-pair det/plain ratios), the first pair of each phase left out."""
    with tempfile.TemporaryDirectory() as d:
        lines = _torchrun([os.path.abspath(__file__), "--worker", first], d, "true", args)
    cols_all = COLS + CPU_COLS
    per_mode, pairs = {mode: {c: [] for c in cols_all} for mode in MODES}, {c: [] for c in cols_all}
    for phase in ("sft", "rl"):
        steps = [m for m in lines if m["phase"] == phase]
        steps = steps[2:] if len(steps) % 2 == 0 else steps[2:-1]  # whole pairs, warm-up pair out
        for a, b in zip(steps[0::2], steps[1::2]):
            by_mode = {a["bench_mode"]: a, b["bench_mode"]: b}
            cols = _columns([by_mode["deterministic"]])
            plain = _columns([by_mode["plain"]])
            for c in cols_all:
                if cols[c]:
                    per_mode["deterministic"][c] += cols[c]
                    per_mode["plain"][c] += plain[c]
                    pairs[c].append(cols[c][0] / plain[c][0])
    return per_mode, pairs


def run_separate(flag: str, args) -> dict:
    """One run in one mode: its per-step columns, the first step of each phase left out."""
    with tempfile.TemporaryDirectory() as d:
        lines = _torchrun(["-m", "titan_rl.train"], d, flag, args)
    sft = [m for m in lines if m["phase"] == "sft"][1:]
    rl = [m for m in lines if m["phase"] == "rl"][1:]
    return _columns(sft + rl)


def _median_interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 90% bootstrap interval of the median (fixed seed): how far the noise alone moves it."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return meds[int(0.05 * draws)], meds[int(0.95 * draws) - 1]


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return _alternating_worker(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=None, help="runs (default 2; 3 with --separate-runs)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 80; 16 with --separate-runs)")
    ap.add_argument("--sft-steps", type=int, default=None, help="of which SFT (default 40; 8 with --separate-runs)")
    ap.add_argument("--separate-runs", action="store_true", help="each mode in its own runs (see the docstring)")
    ap.add_argument("--sft-batch", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sep = args.separate_runs
    args.repeats = args.repeats or (3 if sep else 2)
    args.steps = args.steps or (16 if sep else 80)
    args.sft_steps = args.sft_steps or (8 if sep else 40)
    if args.repeats < 1 or args.sft_steps < 4 or args.steps - args.sft_steps < 4:
        raise SystemExit("need --repeats >= 1 and at least 4 SFT and 4 RL steps (--sft-steps, --steps)")

    cols = COLS if sep else COLS + CPU_COLS
    steps = {mode: {c: [] for c in cols} for mode in MODES}
    ratios = {c: [] for c in cols}
    loads: list[dict] = []
    order = list(MODES)
    for k in range(args.repeats):
        first = order[k % 2]
        load = os.getloadavg()[0]
        if sep:
            got = {}
            for mode in (order if k % 2 == 0 else order[::-1]):
                loads.append({"repeat": k, "mode": mode, "load_1min_before": load})
                got[mode] = run_separate(MODES[mode], args)
                load = os.getloadavg()[0]
            for c in cols:
                ratios[c].append(statistics.median(got["deterministic"][c]) / statistics.median(got["plain"][c]))
        else:
            loads.append({"repeat": k, "odd_steps": first, "load_1min_before": load})
            got, pairs = run_alternating(first, args)
            for c in cols:
                ratios[c] += pairs[c]
        for mode in MODES:
            for c in cols:
                steps[mode][c] += got[mode][c]
        print(f"repeat {k + 1}/{args.repeats} (load {load:.1f} before): median SFT step det "
              f"{statistics.median(got['deterministic']['sft_step']):.3f}s plain "
              f"{statistics.median(got['plain']['sft_step']):.3f}s, RL step det "
              f"{statistics.median(got['deterministic']['rl_step']):.3f}s plain "
              f"{statistics.median(got['plain']['rl_step']):.3f}s", flush=True)

    ratio = {c: statistics.median(v) for c, v in ratios.items()}
    interval = {c: _median_interval(v) for c, v in ratios.items()}
    medians = {mode: {c: statistics.median(steps[mode][c]) for c in cols} for mode in MODES}
    minima = {mode: {c: min(steps[mode][c]) for c in cols} for mode in MODES}
    ratio_min = {c: minima["deterministic"][c] / minima["plain"][c] for c in cols}
    statistic = ("median over repeats of det/plain of each repeat's two runs' median step times" if sep else
                 "median over all (det, plain) pairs of adjacent steps of det step time / plain step time")
    load_list = ", ".join(f"{x['load_1min_before']:.1f}" for x in loads)
    print(f"\nFSDP = 2 ({args.dtype}, debug model), seconds per step (median over steps); "
          f"ratio: {statistic}; load before each run: {load_list}")
    print(f"{'':17s}" + "".join(f"{c:>15s}" for c in cols))
    for mode in MODES:
        print(f"{mode:17s}" + "".join(f"{medians[mode][c]:>14.3f}s" for c in cols))
    print(f"{'ratio det/plain':17s}" + "".join(f"{ratio[c]:>14.2f}x" for c in cols))
    print(f"{'  90% interval':17s}" + "".join(f"{f'{interval[c][0]:.2f}-{interval[c][1]:.2f}':>15s}" for c in cols))
    print(f"{'ratio of minima':17s}" + "".join(f"{ratio_min[c]:>14.2f}x" for c in cols))
    if not sep:
        print("sft_cpu / rl_cpu: CPU seconds of the step, all threads of both ranks (less moved by the load)")
    if args.json:
        from titan_rl.jsonout import write_json

        write_json(args.json, {
            "sft_ratio": ratio["sft_step"], "rl_ratio": ratio["rl_step"], "statistic": statistic,
            "design": "separate runs" if sep else "alternating steps", "ratio_deterministic_over_plain": ratio,
            "ratio_interval_90": interval, "ratios": ratios, "ratio_of_minima": ratio_min,
            "median_seconds": medians, "min_seconds": minima,
            "loads": loads, "steps_per_mode": {c: len(steps["plain"][c]) for c in ("sft_step", "rl_step")},
            **({} if sep else {"cpu_sft_ratio": ratio["sft_cpu"], "cpu_rl_ratio": ratio["rl_cpu"]}),
            "settings": vars(args)})
    return 0


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
