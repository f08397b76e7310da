"""The parity table of the real hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) on folders
transformers writes, in one run:

    python scripts/parity_hybrids.py [--num-prompts 40] [--json outputs/parity_hybrids.json]

exact fp32 / bf16: `python -m titan_rl.parity --model.name=auto --kernels exact` on the
    odd-sized folder (hidden 200, vocab 997, GDN head dims 32 / 16, conv width 3).
stock bf16: the same command with `--kernels both` on a folder of the shapes vLLM's own CPU
    ops take (titan_rl.hf_reference --stock-shapes): vLLM's built-in model and its CPU GDN
    op against our model in plain torch; also exact on that folder.
stock fp32: vLLM's CPU GDN op refuses fp32 ("CPU GDN attention requires BF16."), so the
    parity command's stock column is transformers' own pair (titan_rl.stock_pair): its
    recurrent cached decode samples, its chunked forward over the whole sequence rescores,
    on the odd-sized folder.
For each stock pair: max and mean |dlogp| over the sampled tokens and by position slice
(where in the sequence the mismatch grows). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from titan_rl import quiet

quiet.install()  # before torch, torchao and vLLM load

import torch

from titan_rl import parity
from titan_rl.hf_reference import ARCHS, hf_model
from titan_rl.jsonout import write_json

SLICES = [(0, 8), (8, 16), (16, 32), (32, 48), (48, 64)]


def by_position(pos: torch.Tensor, err: torch.Tensor) -> list[dict]:
    out = []
    for a, b in SLICES:
        m = (pos >= a) & (pos < b)
        if m.any():
            out.append({"positions": f"{a}-{b - 1}", "tokens": int(m.sum()), "max": float(err[m].max()),
                        "mean": float(err[m].mean())})
    return out


def run_parity(folder: str, dtype: str, kernels: str, n: int, work: str) -> dict:
    out = os.path.join(work, f"{os.path.basename(folder)}-{dtype}-{kernels}.json")
    rc = parity.main(["--config", "train_configs/debug_hybrid.toml", "--kernels", kernels, "--num-prompts", str(n),
                      "--detail", "--json", out, "--model.name=auto", f"--model.checkpoint={folder}",
                      f"--model.dtype={dtype}", "--rollout.max_model_len=512"])
    if rc:
        raise SystemExit(f"parity failed on {folder} ({dtype}, {kernels}): rc {rc}")
    with open(out) as f:
        return {r["engine"]: r for r in json.load(f)["results"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--json", default="outputs/parity_hybrids.json")
    args = ap.parse_args(argv)
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        for arch in ARCHS:
            odd, stock = os.path.join(work, f"{arch}_odd"), os.path.join(work, f"{arch}_stock")
            hf_model(arch, 0, scale=0.2).save_pretrained(odd)
            hf_model(arch, 0, scale=0.2, stock_shapes=True).save_pretrained(stock)
            fp32 = run_parity(odd, "float32", "both", args.num_prompts, work)  # stock: transformers' pair
            row = {"exact_fp32": fp32["exact"], "exact_bf16": run_parity(odd, "bfloat16", "exact", args.num_prompts,
                                                                          work)["exact"]}
            both = run_parity(stock, "bfloat16", "both", args.num_prompts, work)
            row["exact_bf16_stock_shapes"] = both["exact"]
            row["stock_bf16_vllm"], row["stock_fp32_transformers"] = both["stock"], fp32["stock"]
            for c in ("stock_bf16_vllm", "stock_fp32_transformers"):
                r = row[c]
                r["by_position"] = by_position(torch.tensor(r["position"]), torch.tensor(r["log_ratio"]).abs())
            for r in row.values():  # per-token arrays are not needed in the summary
                for k in ("log_ratio", "pi", "mu", "position", "entropy", "contract"):
                    r.pop(k, None)
            rows[arch] = row
    cols = ["exact_fp32", "exact_bf16", "exact_bf16_stock_shapes", "stock_bf16_vllm", "stock_fp32_transformers"]
    print(f"\n{'arch':12s} {'cell':26s} {'tokens':>7s} {'bitwise':>8s} {'max|dlogp|':>11s} {'mean|dlogp|':>12s} "
          f"{'full-vocab max':>15s} {'experts differ':>15s}")
    for arch, row in rows.items():
        for c in cols:
            r = row[c]
            fv, ed = r.get("full_vocab_max_abs_dlogp"), r.get("expert_disagreement")
            print(f"{arch:12s} {c:26s} {r['tokens']:7d} {r['bitwise_fraction']:8.3f} {r['max_abs_dlogp']:11.4g} "
                  f"{r['mean_abs_dlogp']:12.4g} {'-' if fv is None else f'{fv:.4g}':>15s} "
                  f"{'-' if ed is None else f'{ed:.2%}':>15s}")
    print("\nstock mismatch by position of the sampled token (mean / max |dlogp|)")
    for arch, row in rows.items():
        for c in ("stock_bf16_vllm", "stock_fp32_transformers"):
            cells = "  ".join(f"{p['positions']}: {p['mean']:.3g}/{p['max']:.3g}" for p in row[c]["by_position"])
            print(f"{arch:12s} {c:26s} {cells}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    write_json(args.json, {"rows": rows, "threads": torch.get_num_threads()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
