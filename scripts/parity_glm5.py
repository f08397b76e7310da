"""GLM-5's parity table (issue 19) on a folder transformers writes, in one run:

    python scripts/parity_glm5.py [--num-prompts 40] [--json outputs/parity_glm5.json]

For fp32 and bf16, and rollout.index_selection pinned and replay, `python -m titan_rl.parity
--config train_configs/debug_glm5.toml --model.name=auto --model.checkpoint=DIR --kernels both`:
exact (our wrapper in vLLM and the trainer-side model) beside stock (vLLM's CPU build has no
sparse-attention backend, so transformers' own pair: its cached decode samples, its full forward
rescores; under replay the forward attends to the decode's recorded key sets). Each cell: bitwise
fraction, max / mean |dlogp|, full-vocab max |dlogp|, index and expert disagreement, and the bytes
per token the mode ships. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from titan_rl import quiet

quiet.install()  # before torch, torchao and vLLM load

import torch

from titan_rl import parity
from titan_rl.hf_reference import hf_model
from titan_rl.jsonout import write_json

KEYS = ("tokens", "bitwise_fraction", "max_abs_dlogp", "mean_abs_dlogp", "full_vocab_max_abs_dlogp",
        "index_disagreement", "expert_disagreement", "index_bytes_per_token", "index_record_bytes_per_token",
        "indexed_positions", "rollout_seconds", "stock_source")


def run_parity(folder: str, dtype: str, mode: str, n: int, seed: int, work: str) -> dict:
    out = os.path.join(work, f"{dtype}-{mode}.json")
    t0 = time.perf_counter()
    rc = parity.main(["--config", "train_configs/debug_glm5.toml", "--kernels", "both", "--num-prompts", str(n),
                      "--seed", str(seed), "--json", out, "--model.name=auto", f"--model.checkpoint={folder}",
                      f"--model.dtype={dtype}", f"--rollout.index_selection={mode}"])
    if rc:
        raise SystemExit(f"parity failed ({dtype}, {mode}): rc {rc}")
    with open(out) as f:
        res = {r["engine"]: {k: r.get(k) for k in KEYS} for r in json.load(f)["results"]}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="outputs/parity_glm5.json")
    args = ap.parse_args(argv)
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    cells = {}
    with tempfile.TemporaryDirectory() as work:
        folder = os.path.join(work, "glm5")
        hf_model("glm_moe_dsa", args.seed, scale=0.2).save_pretrained(folder)
        for dtype in ("float32", "bfloat16"):
            for mode in ("pinned", "replay"):
                cells[f"{dtype}/{mode}"] = run_parity(folder, dtype, mode, args.num_prompts, args.seed, work)
    print(f"\n{'cell':18s} {'engine':7s} {'tokens':>7s} {'bitwise':>8s} {'max|dlogp|':>11s} {'mean|dlogp|':>12s} "
          f"{'full-vocab max':>15s} {'index differ':>13s} {'experts differ':>15s} {'index B/tok':>12s}")
    for cell, res in cells.items():
        for engine in ("exact", "stock"):
            r = res[engine]
            print(f"{cell:18s} {engine:7s} {r['tokens']:7d} {r['bitwise_fraction']:8.3f} {r['max_abs_dlogp']:11.4g} "
                  f"{r['mean_abs_dlogp']:12.4g} {r['full_vocab_max_abs_dlogp']:15.4g} {r['index_disagreement']:13.2%} "
                  f"{r['expert_disagreement']:15.2%} {r['index_bytes_per_token']:12d}")
    print(f"\nstock column: {cells['float32/pinned']['stock']['stock_source']}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    write_json(args.json, {"cells": cells, "threads": torch.get_num_threads(), "num_prompts": args.num_prompts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
