"""What exactness costs: exact vs stock, side by side in one run, as ratios.

    python scripts/bench_parity_overhead.py [--flavor small] [--layers N] [--checkpoint DIR]
        [--prompt-len L] [--skip-train] [--json OUT]

rollout: the same prompts through vLLM with our exact wrapper vs vLLM's built-in
         implementation (generated tokens/s, prefill included), each with its own sampler
         (processed log-probs, as RL runs: ours samples through kernels.sampling). The
         built-in one runs both ways, eager and vLLM's default CPU configuration
         (torch.compile with inductor); the faster is the stock column (`stock_config`),
         and the JSON keeps both ratios (`rollout_slowdown_vs_eager` / `_vs_compiled`).
train:   trainer forward+backward tokens/s of our model with kernels="exact" vs
         kernels="stock" (F.linear, SDPA), same batch, interleaved repeats. Stock runs
         eager and under torch.compile (inductor, forward and backward); the faster is the
         train stock column (`train_stock_config`), and the JSON keeps both ratios
         (`train_slowdown_vs_eager` / `_vs_compiled`). The exact trainer stays eager.
slowdown = exact time / stock time (1.0 = free). Prints a table, writes JSON.

The model: a Qwen3 flavor with random weights (`--flavor`, `--layers N` keeps the first
N layers: `--flavor 0.6B --layers 4` is Qwen3-0.6B's widths and vocabulary, 4 layers),
or any HF folder of a registered architecture with a vLLM built-in twin
(`--checkpoint DIR`). Prompts: 8..200 tokens at random, or all `--prompt-len L` tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import tempfile
import time

from titan_rl import malloc, quiet

quiet.install()  # before torch, torchao and vLLM load

import torch

from titan_rl.checkpoint import save_hf_folder
from titan_rl.jsonout import write_json
from titan_rl.models.options import ModelOptions


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


def flop_counter(model):
    """lengths -> FLOPs of a forward over sequences of those lengths (numbers only: the model
    can go): 2 per weight a token multiplies
    (every 2-D weight but the embedding, the LM head counted once even when tied; a routed
    expert's weights x num_experts_per_tok / num_experts) plus causal attention in the
    full-attention layers (4 * position * heads * head_dim per token and layer) and, in a
    hybrid's GDN layers, 6 * value heads * dk * dv per token (the state's decay, update and read:
    the recurrent form's count)."""
    cfg = model.cfg
    weights = 0.0
    for name, p in model.named_parameters():
        if p.dim() != 2 or "embed_tokens" in name:
            continue
        share = cfg.num_experts_per_tok / cfg.num_experts if ".experts." in name else 1.0
        weights += p.numel() * share
    if cfg.tie_word_embeddings:
        weights += cfg.vocab_size * cfg.hidden_size
    layers = range(cfg.num_hidden_layers)
    full = [i for i in layers if not hasattr(cfg, "is_full_attention") or cfg.is_full_attention(i)]
    gdn = cfg.num_hidden_layers - len(full)
    attn = len(full) * 4 * cfg.num_attention_heads * cfg.head_dim
    rec = gdn * 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim if gdn else 0
    return lambda lengths: sum(n * (2 * weights + rec) + attn * n * (n + 1) / 2 for n in lengths)


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    """KV cache bytes a token takes in the full-attention layers (a hybrid's GDN layers keep a
    state per sequence instead, a few MiB: the cache's floor of 512 MiB covers them)."""
    layers = range(cfg.num_hidden_layers)
    full = sum(1 for i in layers if not hasattr(cfg, "is_full_attention") or cfg.is_full_attention(i))
    return 2 * full * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize


def bench_rollout(folder, cfg, arch, args, flops):
    from vllm import SamplingParams

    from titan_rl.vllm.engine import EngineSettings, make_llm

    g = torch.Generator().manual_seed(0)
    lengths = ([args.prompt_len] * args.prompts if args.prompt_len else
               [int(n) for n in torch.randint(8, 200, (args.prompts,), generator=g)])
    prompts = [{"prompt_token_ids": torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist()} for n in lengths]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    out = {}
    from titan_rl.vllm.sampling import vllm_own_top_k_top_p
    max_len = max(lengths) + args.max_tokens
    kv_mib = max(512, int(1.25 * sum(lengths + [args.max_tokens * len(lengths)])
                          * kv_bytes_per_token(cfg, getattr(torch, args.dtype))) >> 20)
    # As RL runs (titan_rl.rl.engine_link): processed log-probs, so the exact engine samples
    # through our top-k/top-p kernel; the stock engine through vLLM's own (its calls below
    # run inside vllm_own_top_k_top_p: the kernel is installed process-wide).
    # the stock engine both ways: eager (what RL runs use: in-place weight updates) and vLLM's
    # default CPU configuration (torch.compile with inductor); the faster is the baseline
    engines = {name: make_llm(folder, EngineSettings(arch=arch, kernels=kernels, dtype=args.dtype, kv_cache_mib=kv_mib,
                                                     max_num_seqs=args.prompts, max_model_len=max(1024, max_len),
                                                     logprobs_mode="processed_logprobs", compiled=compiled))
               for name, kernels, compiled in (("exact", "exact", False), ("stock_eager", "stock", False),
                                               ("stock_compiled", "stock", True))
               if compiled <= args.compiled_stock}
    stock_sampler = contextlib.nullcontext if args.shared_sampler else vllm_own_top_k_top_p
    own = {e: contextlib.nullcontext if e == "exact" else stock_sampler for e in engines}
    for e, llm in engines.items():  # warm-up
        with own[e]():
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    times = {e: [] for e in engines}
    for _ in range(args.repeats):
        for e, llm in engines.items():
            llm.reset_prefix_cache()
            t = time.perf_counter()
            with own[e]():
                llm.generate(prompts, sp, use_tqdm=False)
            times[e].append(time.perf_counter() - t)
    for e in engines:
        best = min(times[e])
        out[e] = {"seconds": best, "tokens_per_s": args.prompts * args.max_tokens / best}
    faster_stock(out)
    # every prompt token and every generated token but the last goes through the model once
    out["flops"] = flops([len(p["prompt_token_ids"]) + args.max_tokens - 1 for p in prompts])
    out["prompt_tokens"] = sum(lengths)
    return out


def build_pair(args):
    """{"exact": model, "stock": model} in the benchmark's dtype, the same weights."""
    dtype = getattr(torch, args.dtype)
    if args.checkpoint:
        from titan_rl.checkpoint import load_hf_folder
        from titan_rl.registry import architecture_of_folder

        arch = architecture_of_folder(args.checkpoint).name
        return {e: load_hf_folder(args.checkpoint, kernels=e, dtype=dtype, arch=arch) for e in ("exact", "stock")}
    return {e: flavor_model(args, ModelOptions(kernels=e)).to(dtype) for e in ("exact", "stock")}


def flavor_model(args, options=None):
    """The --flavor model with random weights (seed 0), cut to --layers layers."""
    from titan_rl.models.qwen3 import build

    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    return build(args.flavor, options or ModelOptions(), **overrides).init_weights(0)


def faster_stock(out: dict) -> None:
    """out["stock"]: the faster of the stock configurations timed (out["stock_eager"],
    out["stock_compiled"]), named in out["stock_config"]."""
    timed = [e for e in ("stock_eager", "stock_compiled") if e in out]
    out["stock_config"] = min(timed, key=lambda e: out[e]["seconds"])[len("stock_"):]
    out["stock"] = out[f"stock_{out['stock_config']}"]


def slowdowns(res: dict, k: str) -> None:
    """res[k + "_slowdown"] (exact / the stock column) and one ratio per stock configuration."""
    r = res[k]
    res[f"{k}_slowdown"] = r["exact"]["seconds"] / r["stock"]["seconds"]
    for c in ("eager", "compiled"):
        if f"stock_{c}" in r:
            res[f"{k}_slowdown_vs_{c}"] = r["exact"]["seconds"] / r[f"stock_{c}"]["seconds"]


def bench_train(models, args):
    """Seconds per forward+backward of each model, the best of --repeats interleaved runs;
    stock both eager and compiled (torch.compile, inductor: the compiled one is the same
    module, so the same weights), the faster being the `stock` column."""
    torch.manual_seed(0)
    tokens = torch.randint(0, models["exact"].cfg.vocab_size, (args.train_batch, args.train_len))
    models = {"exact": models["exact"], "stock_eager": models["stock"]}
    if args.compiled_stock:
        # a hybrid's GDN reads its sequence starts as Python ints: graph breaks dynamo reports
        # at length (the compiled column is timed as it is, breaks included)
        torch._logging.set_logs(dynamo=logging.ERROR)
        models["stock_compiled"] = torch.compile(models["stock_eager"])
    times = {e: [] for e in models}

    def step(m):
        logits = m(tokens)
        loss = logits.log_softmax(-1)[..., :-1, :].gather(-1, tokens[:, 1:, None]).mean()
        loss.backward()
        m.zero_grad(set_to_none=True)

    for _ in range(args.train_warmup):  # the heap reaches its high-water mark (titan_rl/malloc.py)
        for m in models.values():
            step(m)
    for _ in range(args.repeats):
        for e, m in models.items():
            t = time.perf_counter()
            step(m)
            times[e].append(time.perf_counter() - t)
    n = tokens.numel()
    out = {e: {"seconds": min(times[e]), "tokens_per_s": n / min(times[e])} for e in models}
    faster_stock(out)
    out["flops"] = 3 * flop_counter(models["exact"])([args.train_len] * args.train_batch)  # fwd + 2x bwd
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--layers", type=int, default=0, help="keep the flavor's first N layers (0: all)")
    ap.add_argument("--checkpoint", default=None, help="an HF folder instead of --flavor")
    ap.add_argument("--prompt-len", type=int, default=0, help="every prompt this many tokens (0: 8..200 at random)")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--shared-sampler", action="store_true",
                    help="both engines sample through our top-k/top-p kernel: the ratio of the models alone")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-len", type=int, default=256)
    ap.add_argument("--train-warmup", type=int, default=2, help="untimed steps of each trainer before the timed ones")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-rollout", action="store_true")
    ap.add_argument("--no-compiled-stock", dest="compiled_stock", action="store_false",
                    help="skip the compiled stock columns (vLLM's default CPU configuration, ~25 s of compiling; "
                         "the stock trainer under torch.compile)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if args.checkpoint and args.layers:
        ap.error("--layers cuts a --flavor model; a --checkpoint folder is used as it is")
    label = args.checkpoint or (args.flavor + (f", {args.layers} layers" if args.layers else ""))
    res = {"model": label, "flavor": None if args.checkpoint else args.flavor, "layers": args.layers or None,
           "checkpoint": args.checkpoint, "prompt_len": args.prompt_len or "8..200", "dtype": args.dtype,
           "threads": torch.get_num_threads(), "sampler": "shared" if args.shared_sampler else "own",
           # how this process's memory is kept (titan_rl/malloc.py): both columns run under it
           "glibc_keeps_memory": malloc.apply(), "glibc_tunables": malloc.STARTED_WITH_TUNABLES}
    models = build_pair(args)
    cfg, arch, flops = models["exact"].cfg, _arch_name(models["exact"]), flop_counter(models["exact"])
    res["params"] = sum(p.numel() for p in models["exact"].parameters())
    if not args.skip_train:
        res["train"] = bench_train(models, args)
        slowdowns(res, "train")
        res["train_stock_config"] = res["train"]["stock_config"]
    if not args.skip_rollout:
        with tempfile.TemporaryDirectory() as d:
            folder = args.checkpoint
            if folder is None:
                save_hf_folder(models["exact"], d, dtype=getattr(torch, args.dtype))
                folder = d
            del models
            res["rollout"] = bench_rollout(folder, cfg, arch, args, flops)
        slowdowns(res, "rollout")
        res["stock_config"] = res["rollout"]["stock_config"]
    # The physical limit: every FLOP at the platform's measured GEMM peak in the dtype the
    # exact engine's GEMMs run in (kernels.matmul.gemm_dtype).
    from titan_rl.kernels.matmul.torch_impl import bf16_gemm, gemm_dtype

    peak_dtype = gemm_dtype(getattr(torch, args.dtype))
    res["gemm_peak_gflops"] = gemm_peak_gflops(peak_dtype)
    res["gemm_peak_dtype"] = str(peak_dtype).replace("torch.", "")
    res["bf16_gemm"] = bf16_gemm()
    for k in ("train", "rollout"):
        if k in res:
            limit = res[k]["flops"] / (res["gemm_peak_gflops"] * 1e9)
            res[k]["limit_seconds"] = limit
            for e in ("exact", "stock", "stock_eager", "stock_compiled"):
                if e in res[k]:
                    res[k][e]["x_limit"] = res[k][e]["seconds"] / limit
    print(f"\nmodel {label} ({res['params'] / 1e6:.0f}M parameters), prompts {res['prompt_len']} tokens, "
          f"sampler {res['sampler']}")
    print(f"{'what':28s}{'exact tok/s':>14s}{'stock tok/s':>14s}{'slowdown':>10s}"
          f"{'exact/limit':>13s}{'stock/limit':>13s}")
    for k in ("train", "rollout"):
        if k in res:
            r = res[k]
            print(f"{k + ' (' + args.dtype + ')':28s}{r['exact']['tokens_per_s']:>14.1f}"
                  f"{r['stock']['tokens_per_s']:>14.1f}{res[k + '_slowdown']:>9.2f}x"
                  f"{r['exact']['x_limit']:>12.1f}x{r['stock']['x_limit']:>12.1f}x")
    for k in ("train", "rollout"):  # both stock configurations, the baseline being the faster
        if k not in res:
            continue
        for c in ("eager", "compiled"):
            if f"stock_{c}" in res[k]:
                s = res[k][f"stock_{c}"]
                mark = "  <- the stock column" if c == res[k]["stock_config"] else ""
                print(f"{'  ' + k + ', stock ' + c:28s}{'':>14s}{s['tokens_per_s']:>14.1f}"
                      f"{res[k + '_slowdown_vs_' + c]:>9.2f}x{'':>13s}{s['x_limit']:>12.1f}x{mark}")
    print(f"threads {res['threads']}; limit = FLOPs at the measured {res['gemm_peak_dtype']} GEMM peak "
          f"({res['gemm_peak_gflops']:.1f} GFLOP/s); bf16 GEMM form here: {bf16_gemm()}")
    if args.json:
        write_json(args.json, res)
    return 0


def _arch_name(model) -> str:
    from titan_rl.registry import architecture_of

    return architecture_of(model).name


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
