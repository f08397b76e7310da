"""What exactness costs: exact vs stock, side by side in one run, as ratios.

    python scripts/bench_parity_overhead.py [--flavor small] [--json OUT]

rollout: the same prompts through vLLM with our exact wrapper vs vLLM's built-in
         implementation (generated tokens/s, prefill included).
train:   trainer forward+backward tokens/s of our model with kernels="exact" vs
         kernels="stock" (F.linear, SDPA), same batch, interleaved repeats.
slowdown = exact time / stock time (1.0 = free). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from titan_rl import quiet

quiet.install()  # before torch, torchao and vLLM load

import torch

from titan_rl.checkpoint import save_hf_folder
from titan_rl.jsonout import write_json
from titan_rl.models.options import ModelOptions
from titan_rl.models.qwen3 import build


def gemm_peak_gflops(dtype: torch.dtype, n: int = 1024, seconds: float = 0.5) -> float:
    """Measured GEMM throughput (GFLOP/s) of an n^3 torch.mm in `dtype` at the current thread count."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    t, k = time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        torch.mm(a, b)
        k += 1
    return 2 * n**3 * k / (time.perf_counter() - t) / 1e9


def forward_flops(cfg, lengths) -> float:
    """FLOPs of a forward over sequences of the given lengths: 2 per weight per token
    (decoder linears + LM head) plus causal attention (4 * position * heads * head_dim
    per token and layer)."""
    e, i, h, hkv, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_layer = e * (h * d) * 2 + e * (hkv * d) * 2 + 3 * e * i
    dense = 2 * (cfg.num_hidden_layers * per_layer + e * cfg.vocab_size)
    total = 0.0
    for n in lengths:
        total += n * dense + cfg.num_hidden_layers * 4 * h * d * n * (n + 1) / 2
    return total


def bench_rollout(folder, args):
    from vllm import SamplingParams

    from titan_rl.vllm.engine import make_llm

    g = torch.Generator().manual_seed(0)
    vocab = build(args.flavor).cfg.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(2, vocab, (int(n),), generator=g).tolist()}
               for n in torch.randint(8, 200, (args.prompts,), generator=g)]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    out = {}
    engines = {e: make_llm(folder, kernels=e, dtype=args.dtype, kv_cache_mib=512, max_num_seqs=args.prompts)
               for e in ("exact", "stock")}
    for e, llm in engines.items():  # warm-up
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    times = {e: [] for e in engines}
    for _ in range(args.repeats):
        for e, llm in engines.items():
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            times[e].append(time.perf_counter() - t)
    for e in engines:
        best = min(times[e])
        out[e] = {"seconds": best, "tokens_per_s": args.prompts * args.max_tokens / best}
    # every prompt token and every generated token but the last goes through the model once
    out["flops"] = forward_flops(build(args.flavor).cfg, [len(p["prompt_token_ids"]) + args.max_tokens - 1
                                                           for p in prompts])
    return out


def bench_train(args):
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    models = {}
    for e in ("exact", "stock"):
        models[e] = build(args.flavor, ModelOptions(kernels=e)).init_weights(0).to(dtype)
    tokens = torch.randint(0, models["exact"].cfg.vocab_size, (args.train_batch, args.train_len))
    times = {e: [] for e in models}

    def step(m):
        logits = m(tokens)
        loss = logits.log_softmax(-1)[..., :-1, :].gather(-1, tokens[:, 1:, None]).mean()
        loss.backward()
        m.zero_grad(set_to_none=True)

    for m in models.values():
        step(m)  # warm-up
    for _ in range(args.repeats):
        for e, m in models.items():
            t = time.perf_counter()
            step(m)
            times[e].append(time.perf_counter() - t)
    n = tokens.numel()
    out = {e: {"seconds": min(times[e]), "tokens_per_s": n / min(times[e])} for e in models}
    out["flops"] = 3 * forward_flops(models["exact"].cfg, [args.train_len] * args.train_batch)  # fwd + 2x bwd
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-rollout", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    res = {"flavor": args.flavor, "dtype": args.dtype, "threads": torch.get_num_threads()}
    res["train"] = bench_train(args)
    res["train_slowdown"] = res["train"]["exact"]["seconds"] / res["train"]["stock"]["seconds"]
    if not args.skip_rollout:
        with tempfile.TemporaryDirectory() as d:
            save_hf_folder(build(args.flavor).init_weights(0), d, dtype=getattr(torch, args.dtype))
            res["rollout"] = bench_rollout(d, args)
        res["rollout_slowdown"] = res["rollout"]["exact"]["seconds"] / res["rollout"]["stock"]["seconds"]
    # The physical limit: every FLOP at the platform's measured GEMM peak in the dtype the
    # exact engine's GEMMs run in (kernels.matmul.gemm_dtype).
    from titan_rl.kernels.matmul.torch_impl import BF16_GEMM, gemm_dtype

    peak_dtype = gemm_dtype(getattr(torch, args.dtype))
    res["gemm_peak_gflops"] = gemm_peak_gflops(peak_dtype)
    res["gemm_peak_dtype"] = str(peak_dtype).replace("torch.", "")
    res["bf16_gemm"] = BF16_GEMM
    for k in ("train", "rollout"):
        if k in res:
            limit = res[k]["flops"] / (res["gemm_peak_gflops"] * 1e9)
            res[k]["limit_seconds"] = limit
            for e in ("exact", "stock"):
                res[k][e]["x_limit"] = res[k][e]["seconds"] / limit
    print(f"\n{'what':28s}{'exact tok/s':>14s}{'stock tok/s':>14s}{'slowdown':>10s}"
          f"{'exact/limit':>13s}{'stock/limit':>13s}")
    for k in ("train", "rollout"):
        if k in res:
            r = res[k]
            print(f"{k + ' (' + args.flavor + ', ' + args.dtype + ')':28s}{r['exact']['tokens_per_s']:>14.1f}"
                  f"{r['stock']['tokens_per_s']:>14.1f}{res[k + '_slowdown']:>9.2f}x"
                  f"{r['exact']['x_limit']:>12.1f}x{r['stock']['x_limit']:>12.1f}x")
    print(f"threads {res['threads']}; limit = FLOPs at the measured {res['gemm_peak_dtype']} GEMM peak "
          f"({res['gemm_peak_gflops']:.1f} GFLOP/s); bf16 GEMM form here: {BF16_GEMM}")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
