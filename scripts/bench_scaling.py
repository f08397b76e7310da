"""How exactness's cost grows: exact / stock against sequence length, batch size and width.

One table (issue 34, item 5: a cost that grows with length is a cost at 32k).

    python scripts/bench_scaling.py [--dtype bfloat16] [--repeats 2] [--axes length,batch,width]
        [--what train,rollout] [--json OUT]

Each point is one run of scripts/bench_parity_overhead.py (its own process, so one point's
engines and compiled graphs never share memory with the next), exact and stock side by side
in that run, the stock column the faster of eager and compiled. The axes vary one thing from
a base point (the small flavor; trainer 4 x 256 tokens; rollouts of 8 prompts of 64 tokens,
32 sampled):
  length  trainer sequences of 256, 1024, 4096 tokens at 4096 tokens a step (16 x 256 ... 1 x 4096);
          rollout prompts of 64, 1024, 4064 tokens (+ 32 sampled: the small flavor's 4096 positions;
          4 prompts at 4064)
  batch   trainer 1, 4, 16 sequences of 256; rollouts of 1, 8, 32 prompts
  width   the debug, small and Qwen3-0.6B flavors (0.6B cut to 4 layers: its widths and
          vocabulary, a quarter of the time per token of 28 layers)
Runs at the process's thread count (OMP_NUM_THREADS; 1 for figures that compare machines).
The axes share their base points (each is run once); the JSON is rewritten after every point.
The full grid (14 runs) took 21 minutes at 1 thread (Intel Xeon, bf16); --axes / --what pick a part.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (axis, label, what, bench_parity_overhead arguments)
BASE_TRAIN = ["--train-batch", "4", "--train-len", "256"]
BASE_ROLLOUT = ["--prompts", "8", "--prompt-len", "64", "--max-tokens", "32"]


def points(axes: list[str], what: list[str]) -> list[tuple[str, str, str, list[str]]]:
    out = []
    if "length" in axes:
        if "train" in what:
            out += [("length", f"{n} tokens", "train", ["--train-batch", str(4096 // n), "--train-len", str(n)])
                    for n in (256, 1024, 4096)]
        if "rollout" in what:
            # 4064 + 32 sampled = 4096, the small flavor's max_position_embeddings
            out += [("length", f"{n} tokens", "rollout",
                     ["--prompts", "4" if n >= 4000 else "8", "--prompt-len", str(n), "--max-tokens", "32"])
                    for n in (64, 1024, 4064)]
    if "batch" in axes:
        if "train" in what:
            out += [("batch", f"{b} x 256", "train", ["--train-batch", str(b), "--train-len", "256"]) for b in (1, 4, 16)]
        if "rollout" in what:
            out += [("batch", f"{b} prompts", "rollout", ["--prompts", str(b), "--prompt-len", "64", "--max-tokens", "32"])
                    for b in (1, 8, 32)]
    if "width" in axes:
        for flavor, extra in (("debug", []), ("small", []), ("0.6B", ["--layers", "4"])):
            label = flavor + (", 4 layers" if extra else "")
            for w in what:
                out.append(("width", label, w, ["--flavor", flavor, *extra, *(BASE_TRAIN if w == "train" else BASE_ROLLOUT)]))
    return out


def _normal(extra: list[str]) -> tuple:
    """A point's arguments as a sorted tuple of (flag, value), the flavor default made explicit,
    so that points the axes share compare equal."""
    pairs = dict(zip(extra[::2], extra[1::2]))
    pairs.setdefault("--flavor", "small")
    return tuple(sorted(pairs.items()))


def run_point(what: str, extra: list[str], dtype: str, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "point.json")
        skip = "--skip-rollout" if what == "train" else "--skip-train"
        cmd = [sys.executable, os.path.join(HERE, "bench_parity_overhead.py"), "--dtype", dtype,
               "--repeats", str(repeats), skip, *extra, "--json", out]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return {"error": f"rc {proc.returncode}: " + " | ".join(tail), "wall_seconds": time.perf_counter() - t}
        with open(out) as f:
            res = json.load(f)
    res["wall_seconds"] = time.perf_counter() - t
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--axes", default="length,batch,width")
    ap.add_argument("--what", default="train,rollout")
    ap.add_argument("--json", default="outputs/bench_scaling.json")
    args = ap.parse_args(argv)
    axes, what = args.axes.split(","), args.what.split(",")
    for key, vals, allowed in (("--axes", axes, {"length", "batch", "width"}), ("--what", what, {"train", "rollout"})):
        bad = [v for v in vals if v not in allowed]
        if bad:
            ap.error(f"{key}: {bad} not among {sorted(allowed)}")
    from titan_rl.jsonout import write_json

    grid = points(axes, what)
    rows, done = [], {}
    for i, (axis, label, w, extra) in enumerate(grid, 1):
        key = (w, *_normal(extra))
        print(f"[{i}/{len(grid)}] {axis}: {label}, {w}" + (" (measured above)" if key in done else " ..."), flush=True)
        if key not in done:  # the axes share their base points: each is run once
            done[key] = run_point(w, extra, args.dtype, args.repeats)
        res = done[key]
        row = {"axis": axis, "point": label, "what": w, "args": extra, "wall_seconds": res["wall_seconds"]}
        if "error" in res:
            row["error"] = res["error"]
            print(f"    failed: {res['error']}", flush=True)
        else:
            r = res[w]
            row.update(exact_tokens_per_s=r["exact"]["tokens_per_s"], stock_tokens_per_s=r["stock"]["tokens_per_s"],
                       stock_config=r["stock_config"], slowdown=res[f"{w}_slowdown"],
                       slowdown_vs_eager=res.get(f"{w}_slowdown_vs_eager"),
                       slowdown_vs_compiled=res.get(f"{w}_slowdown_vs_compiled"), threads=res["threads"],
                       bf16_gemm=res["bf16_gemm"], model=res["model"])
            print(f"    exact/stock {row['slowdown']:.2f}x (stock {row['stock_config']})", flush=True)
        rows.append(row)
        doc = {"dtype": args.dtype, "repeats": args.repeats, "threads": os.environ.get("OMP_NUM_THREADS"),
               "complete": i == len(grid), "points": rows}
        write_json(args.json, doc)  # after every point: a long run stopped early keeps what it measured
    print(f"\nexact / the faster stock, {args.dtype}, threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"{'axis':8s}{'point':22s}{'what':9s}{'exact tok/s':>13s}{'stock tok/s':>13s}{'stock':>10s}"
          f"{'exact/stock':>13s}{'vs eager':>10s}")
    for r in rows:
        if "error" in r:
            print(f"{r['axis']:8s}{r['point']:22s}{r['what']:9s}  failed")
            continue
        eager = f"{r['slowdown_vs_eager']:.2f}x" if r["slowdown_vs_eager"] else "-"
        print(f"{r['axis']:8s}{r['point']:22s}{r['what']:9s}{r['exact_tokens_per_s']:>13.1f}"
              f"{r['stock_tokens_per_s']:>13.1f}{r['stock_config']:>10s}{r['slowdown']:>12.2f}x{eager:>10s}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
