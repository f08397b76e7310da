"""A before/after sweep for behaviour-neutral changes: every architecture x exact/stock x
fp32/bf16 (and the quantized recipes on the debug model), each the shortest RL run (1 SFT step,
2 RL steps), its metrics.jsonl kept without wall-clock fields (titan_rl.run_dir.comparable).
Run it on the code before a refactor and after, then compare: every cell's lines must be equal
(the loss, grad_norm, rollout_sha256, the weight digests and the mismatch are in them).

  python scripts/behaviour_sweep.py --json outputs/sweep_before.json       # on the old code
  python scripts/behaviour_sweep.py --json outputs/sweep_after.json        # on the new code
  python scripts/behaviour_sweep.py --compare outputs/sweep_before.json outputs/sweep_after.json

Prints a table (cell, lines, seconds / equal or the first differing key) and writes the JSON.
About 40 runs of 10-25 s each on 2 cores (two at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ARCHS = {"qwen3": "debug", "llama": "debug", "qwen3_moe": "debug_moe", "qwen3_hybrid": "debug_hybrid",
         "qwen3_next": "debug_qwen3_next", "qwen3_5": "debug_qwen35", "qwen3_5_moe": "debug_qwen35_moe",
         "glm_moe_dsa": "debug_glm5"}
SHORT = ["--training.steps=3", "--algorithm.sft_steps=1", "--algorithm.sft_batch=8", "--algorithm.prompts_per_step=2",
         "--algorithm.group_size=4", "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=false"]


def cells() -> dict[str, list[str]]:
    out = {}
    for arch, flavor in ARCHS.items():
        for kernels in ("exact", "stock"):
            for dtype in ("float32", "bfloat16"):
                out[f"{arch}/{kernels}/{dtype}"] = [f"--model.name={arch}", f"--model.flavor={flavor}",
                                                    f"--model.kernels={kernels}", f"--model.dtype={dtype}"]
    for recipe in ("fp8_rowwise", "fp8_block", "mxfp8", "nvfp4", "nvfp4_w4a4"):
        out[f"qwen3/exact/bfloat16/{recipe}"] = ["--model.name=qwen3", "--model.flavor=debug", "--model.kernels=exact",
                                                 "--model.dtype=bfloat16", f"--quantization.recipe={recipe}"]
    out["glm_moe_dsa/exact/bfloat16/fp8_rowwise"] = ["--model.name=glm_moe_dsa", "--model.flavor=debug_glm5",
                                                     "--model.dtype=bfloat16", "--quantization.recipe=fp8_rowwise"]
    return out


def run_cell(name: str, args: list[str]) -> dict:
    from titan_rl.run_dir import comparable, read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "titan_rl.train", "--config", "train_configs/rl_debug.toml",
                            "--run-dir", tmp, *SHORT, *args], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
            return {"cell": name, "rc": r.returncode, "last_line": _no_run_dir(tail[0]), "seconds": dt}
        lines = [comparable(m, same_layout=True) for m in read_metrics(tmp)]  # the weight digests kept
        return {"cell": name, "rc": 0, "lines": lines, "seconds": dt}


def _no_run_dir(line: str) -> str:
    """A refusal's line without the temporary run dir it names (it differs run to run)."""
    return re.sub(r"/tmp/tmp[\w]+", "<run dir>", line)


def first_difference(a: list[dict], b: list[dict]) -> str:
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} lines"
    for i, (x, y) in enumerate(zip(a, b)):
        for k in sorted(x.keys() | y.keys()):
            if x.get(k) != y.get(k):
                return f"line {i + 1}: {k}"
    return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the sweep here")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two sweeps' JSON")
    p.add_argument("--cells", nargs="*", help="only these cells (names as the table prints them)")
    a = p.parse_args(argv)
    if a.compare:
        before, after = (json.loads(Path(f).read_text()) for f in a.compare)
        bad = 0
        print(f"{'cell':44s} {'verdict'}")
        for name in sorted(before.keys() | after.keys()):
            x, y = before.get(name), after.get(name)
            if x is None or y is None:
                verdict = "only in " + ("after" if x is None else "before")
            elif x["rc"] != y["rc"]:
                verdict = f"rc {x['rc']} vs {y['rc']}"
            elif x["rc"] != 0:
                same = _no_run_dir(x["last_line"]) == _no_run_dir(y["last_line"])
                verdict = "both refused/failed: " + ("same line" if same else "other lines")
            else:
                d = first_difference(x["lines"], y["lines"])
                verdict = f"DIFFERS ({d})" if d else f"equal ({len(x['lines'])} lines)"
            bad += verdict.startswith(("DIFFERS", "rc", "only")) or "other lines" in verdict
            print(f"{name:44s} {verdict}")
        print(f"{bad} cell(s) differ")
        return 1 if bad else 0
    todo = cells()
    if a.cells:
        todo = {k: v for k, v in todo.items() if k in a.cells}
    out = {}
    with ThreadPoolExecutor(2) as pool:
        for res in pool.map(lambda kv: run_cell(*kv), todo.items()):
            out[res["cell"]] = res
            what = f"{len(res['lines'])} lines" if res["rc"] == 0 else f"rc {res['rc']}: {res['last_line'][:60]}"
            print(f"{res['cell']:44s} {what:70s} {res['seconds']:6.1f} s", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
