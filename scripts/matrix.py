"""Every architecture in every topology, as one command: the shortest RL run per cell, each
compared line by line with its architecture's one-process colocated run.

A cell is (architecture, replay mode, layout, placement):
  replay   "own"    the trainer makes its own choices (router_replay off, index_selection
                    pinned, mask_mode recompute);
           "replay" it takes every choice the engine recorded (its kinds: routes, key
                    indices; kept sets always, top_p = 0.9 in both modes so they matter)
  layout   "1" one process; "fsdp2" torchrun 2 ranks (FSDP); "tp2" torchrun 2, TP 2;
           "ep2" torchrun 2, FSDP 2 with expert parallel 2 (MoE architectures)
  placement "colocated"; "separate" (an engine process, K = 0); "separate_k1" (K = 1)

Every cell runs with model.tp_leaves = 2 so that TP 2 has the bits of TP 1. The reference of
an (architecture, mode) is its one-process colocated cell. A K = 0 cell must write the
reference's metrics.jsonl (wall-clock and memory fields aside: titan_rl.run_dir.comparable);
a K = 1 cell trains on rollouts one step old, so its lines differ by design and it must show
max_abs_dlogp 0 (engine vs trainer at the behaviour weights) and zero disagreement on every
RL line. A refused cell is the validation's one line (exit 2); anything else that fails is
reported with its last line and counts as a failure.

  python scripts/matrix.py --arch qwen3_moe glm_moe_dsa --layout 1 fsdp2 --json outputs/matrix.json

Prints the table (cell, verdict, equal lines, first differing key, seconds) and writes the
JSON. The whole matrix (8 architectures x 2 modes x 3 layouts x 3 placements) is 144 runs of
20-90 s each on 2 cores; choose a subset with --arch / --mode / --layout / --placement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from titan_rl.launch import free_port  # noqa: E402
from titan_rl.run_dir import comparable, read_metrics  # noqa: E402

# the RL debug config of each architecture (and overrides naming it where a config is shared)
ARCHS = {
    "qwen3": ["--config", "train_configs/rl_debug.toml"],
    "llama": ["--config", "train_configs/rl_debug.toml", "--model.name=llama", "--model.flavor=debug"],
    "qwen3_moe": ["--config", "train_configs/rl_debug_moe.toml"],
    "qwen3_hybrid": ["--config", "train_configs/rl_debug_hybrid.toml"],
    "qwen3_5": ["--config", "train_configs/rl_debug_qwen35.toml"],
    "qwen3_5_moe": ["--config", "train_configs/rl_debug_qwen35.toml", "--model.name=qwen3_5_moe",
                    "--model.flavor=debug_qwen35_moe"],
    "qwen3_next": ["--config", "train_configs/rl_debug_hybrid.toml", "--model.name=qwen3_next",
                   "--model.flavor=debug_qwen3_next"],
    "glm_moe_dsa": ["--config", "train_configs/rl_debug_glm5.toml"],
}
SHORT = ["--training.steps=3", "--algorithm.sft_steps=1", "--algorithm.sft_batch=8", "--algorithm.prompts_per_step=4",
         "--algorithm.group_size=4", "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=false",
         "--model.tp_leaves=2", "--sampling.top_p=0.9"]
LAYOUTS = {"1": (1, []), "fsdp2": (2, []), "tp2": (2, ["--parallelism.tensor_parallel_degree=2"]),
           "ep2": (2, ["--parallelism.expert_parallel_degree=2"])}
PLACEMENTS = {"colocated": [], "separate": ["--rollout.placement=separate"],
              "separate_k1": ["--rollout.placement=separate", "--rollout.max_off_policy_steps=1"]}
MODES = ("own", "replay")


def mode_args(arch: str, mode: str) -> list[str]:
    from titan_rl.registry import get_architecture

    kinds = get_architecture(arch).choice_kinds
    replay = mode == "replay"
    out = [f"--sampling.mask_mode={'replay' if replay else 'recompute'}"]
    if "routes" in kinds:
        out.append(f"--rollout.router_replay={'replay' if replay else 'off'}")
    if "indices" in kinds:
        out.append(f"--rollout.index_selection={'replay' if replay else 'pinned'}")
    return out


def run_cell(arch: str, mode: str, layout: str, placement: str, out_dir: Path, timeout: int,
             extra: list[str] = ()) -> dict:
    procs, layout_args = LAYOUTS[layout]
    run_dir = out_dir / f"{arch}-{mode}-{layout}-{placement}"
    args = ["--run-dir", str(run_dir), *ARCHS[arch], *SHORT, *mode_args(arch, mode), *layout_args,
            *PLACEMENTS[placement], *extra]
    if procs == 1:
        cmd = [sys.executable, "-m", "titan_rl.train", *args]
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, f"--nproc_per_node={procs}", f"--master_port={free_port()}", "-m", "titan_rl.train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        code, said = r.returncode, (r.stdout + "\n" + r.stderr).strip().splitlines()
    except subprocess.TimeoutExpired:
        code, said = None, [f"timed out after {timeout} s"]
    cell = {"arch": arch, "mode": mode, "layout": layout, "placement": placement,
            "seconds": round(time.perf_counter() - t0, 1), "run_dir": str(run_dir)}
    refusal = [line for line in said if line.startswith("config error:")]  # the start-up validation's line
    errors = [line for line in said if line.startswith(("error:", "[rank0]: ")) and "rror" in line]
    if code == 0:
        cell["lines"] = read_metrics(run_dir)
    elif refusal:
        cell["refused"] = refusal[-1]
    else:  # torchrun ends with its own summary: a rank's error line is the one to show
        cell["failed"] = (errors or said or [f"exit {code}"])[-1]
    return cell


def _print(cell: dict) -> None:
    note = cell.get("first_difference") or cell.get("refused") or cell.get("failed") or ""
    print(f"{cell['arch']:12} {cell['mode']:6} {cell['layout']:6} {cell['placement']:12} {cell['verdict']:19} "
          f"{cell.get('equal_lines', ''):18} {cell['seconds']:6.1f}  {note[:150]}", flush=True)


def judge(cell: dict, want: list | None) -> None:
    """cell["verdict"]: equal / exact (K = 1) / differs / refused / failed / no reference."""
    if "refused" in cell or "failed" in cell:
        cell["verdict"] = "refused" if "refused" in cell else "FAILED"
        return
    lines = cell.pop("lines")
    rl = [m for m in lines if m.get("phase") == "rl"]
    if cell["placement"] == "separate_k1":
        bad = [m["step"] for m in rl if m.get("max_abs_dlogp") != 0.0
               or any(m.get(k, 0.0) != 0.0 for k in ("expert_disagreement", "index_disagreement"))]
        cell["verdict"] = "exact vs behaviour" if rl and not bad else "DIFFERS"
        cell["equal_lines"] = f"{len(rl) - len(bad)}/{len(rl)} rl lines at 0"
        return
    if not want:
        cell["verdict"] = "no reference"
        return
    equal = sum(comparable(a) == comparable(b) for a, b in zip(lines, want))
    cell["equal_lines"] = f"{equal}/{len(want)}"
    first = next(((i, sorted(k for k in set(comparable(a)) | set(comparable(b))
                             if comparable(a).get(k) != comparable(b).get(k)))
                  for i, (a, b) in enumerate(zip(lines, want)) if comparable(a) != comparable(b)), None)
    if first is None and len(lines) == len(want):
        cell["verdict"] = "equal"
    else:
        cell["verdict"] = "DIFFERS"
        cell["first_difference"] = f"line {first[0] + 1}: {first[1][0]}" if first else "line count"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--mode", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--layout", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--placement", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    p.add_argument("--out", default=None, help="run dirs go here (default: a temporary folder)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--json", default="outputs/matrix.json")
    p.add_argument("--extra", action="append", default=[], metavar="--KEY=VALUE",
                   help="a config override added to every cell, reference included; repeat it for more "
                        "(e.g. --extra=--parallelism.gradient_leaves=4 --extra=--training.max_norm=0.001)")
    a = p.parse_args(argv)
    out_dir = Path(a.out or tempfile.mkdtemp(prefix="titan_rl_matrix_"))
    cells = []
    print(f"{'arch':12} {'mode':6} {'layout':6} {'placement':12} {'verdict':19} {'equal':18} {'s':>6}  note",
          flush=True)
    for arch, mode in itertools.product(a.arch, a.mode):
        reference = run_cell(arch, mode, "1", "colocated", out_dir, a.timeout, a.extra)
        want = reference.pop("lines", None)
        reference["verdict"] = "reference" if want else ("refused" if "refused" in reference else "FAILED")
        reference["equal_lines"] = f"{len(want)} lines" if want else ""
        _print(reference)
        cells.append(reference)
        for lay, pl in itertools.product(a.layout, a.placement):
            if (lay, pl) != ("1", "colocated"):
                cell = run_cell(arch, mode, lay, pl, out_dir, a.timeout, a.extra)
                judge(cell, want)
                _print(cell)
                cells.append(cell)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"cells": cells, "machine": os.uname().nodename,
                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))
    bad = [c for c in cells if c["verdict"] in ("FAILED", "DIFFERS", "no reference")]
    print(f"{len(cells)} cells: {len(bad)} failed or differ; JSON {a.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
