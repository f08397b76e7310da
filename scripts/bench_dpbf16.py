"""The dpbf16 forms against the forms they replace, on this CPU kind, in one run: the bf16 LM
head (dpbf16 vs the fp32 GEMM on upcast operands) and a quantized linear (the quantized GEMM
on the packed payload vs the dense form: the fake-quantized weight, prepared once, through the
invariant `linear`, the input fake-quantized per call), at decode and prefill row counts.

    python scripts/bench_dpbf16.py [--json OUT]
    TITAN_RL_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench_dpbf16.py

The second line runs it as an AVX2-only machine (kernels/cpu_features.py), where the dpbf16 forms
are FMAs under DAZ/FTZ (csrc/dpbf16_avx2.h). One thread; each cell the least CPU time of interleaved
rounds (both forms timed in the same stretches of machine load, so the ratio holds on a shared
machine).
"""

from __future__ import annotations

import argparse
import time

import torch

from titan_rl.jsonout import write_json
from titan_rl.kernels import cpu_features


def _interleaved(fns: dict, rounds: int) -> dict:
    """{name: least CPU time of a call} over rounds running every fn in turn (one thread: the
    CPU time is what the call itself took, not stretched by other jobs taking the core)."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t0 = time.thread_time()
            fn()
            best[name] = min(best[name], time.thread_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    cpu_features.apply()
    torch.set_num_threads(1)
    from titan_rl.kernels.lm_head import torch_impl as head
    from titan_rl.kernels.matmul.torch_impl import PackedWeight, linear
    from titan_rl.kernels.quant import fake_quantize, quantizes_activations
    from titan_rl.kernels.quant.gemm import PackedQuant, quant_gemm_implementation, quant_linear, quantize_weight

    impl = quant_gemm_implementation()
    g = torch.Generator().manual_seed(0)
    rows = []
    for rows_n, k, n in [(16, 512, 16384), (512, 512, 16384)]:  # the small flavor's head
        h = torch.randn(rows_n, k, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
        packed, w32 = head.lm_head_weight(w), PackedWeight(w.float())
        t = _interleaved({"dpbf16": lambda: head.lm_head_logits(h, packed),
                          "fp32": lambda: linear(h.float(), w32)}, args.rounds)
        rows.append({"op": "lm_head bf16", "shape": f"{rows_n}x{k}x{n}", "new": "dpbf16", "old": "fp32",
                     "new_ms": t["dpbf16"] * 1e3, "old_ms": t["fp32"] * 1e3})
    for recipe in ("fp8_rowwise", "nvfp4", "nvfp4_w4a4"):
        for rows_n, k, n in [(16, 512, 1536), (512, 512, 1536)]:  # a fused gate/up of the small flavor
            x = torch.randn(rows_n, k, generator=g).to(torch.bfloat16)
            w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
            pq = PackedQuant.from_parts(recipe, [quantize_weight(w, recipe)])
            dense = PackedWeight(fake_quantize(w, recipe, "weight"))
            act = quantizes_activations(recipe)
            t = _interleaved({"dpbf16": lambda: quant_linear(x, pq),
                              "dense": lambda: linear(fake_quantize(x, recipe, "activation") if act else x, dense)},
                             args.rounds)
            rows.append({"op": f"{recipe} linear", "shape": f"{rows_n}x{k}x{n}", "new": "dpbf16", "old": "dense",
                         "new_ms": t["dpbf16"] * 1e3, "old_ms": t["dense"] * 1e3})
    print(f"CPU kind {cpu_features.kind()}, ATen {torch.backends.cpu.get_cpu_capability()}, dpbf16 by {impl}, 1 thread")
    print(f"{'op':<20} {'M x K x N':<16} {'dpbf16 ms':>10} {'old form':>9} {'old ms':>9} {'new / old':>10}")
    for r in rows:
        r["ratio"] = r["new_ms"] / r["old_ms"]
        print(f"{r['op']:<20} {r['shape']:<16} {r['new_ms']:>10.3f} {r['old']:>9} {r['old_ms']:>9.3f} {r['ratio']:>10.2f}")
    if args.json:
        write_json(args.json, {"cpu_kind": cpu_features.kind(), "aten": torch.backends.cpu.get_cpu_capability(),
                               "dpbf16": impl, "threads": 1, "rows": rows})


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
