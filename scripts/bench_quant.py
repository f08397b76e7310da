"""What each quantization recipe costs and saves, against the same model unquantized, in
one run (so the ratios compare like with like): engine weight bytes, weight-sync bytes,
rollout tokens/s (vLLM, our wrapper) and trainer tokens/s (forward + backward), plus where
a quantized forward's extra time goes (weight dequantization, activation fake-quant).

    python scripts/bench_quant.py [--flavor debug] [--recipes none,fp8_rowwise,...] [--json OUT]

CPU: every recipe is emulated (the engine dequantizes each payload once per load, then the
invariant bf16/fp32 GEMM; inputs are fake-quantized per call), so "faster" is not expected
here; the bytes are real. "engine deq ms" is that once-per-load cost, for all weights.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from titan_rl import quiet

quiet.install()  # before torch, torchao and vLLM load

import torch  # noqa: E402

from titan_rl.jsonout import write_json  # noqa: E402
from titan_rl.kernels.quant import QUANT_RECIPES, fake_quantize  # noqa: E402


def _time(fn, repeat: int) -> float:
    """The fastest of `repeat` calls after a warm-up: on a shared machine the other jobs only
    ever add time, so the minimum is the least disturbed measurement."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench(arch: str, flavor: str, recipe: str, args) -> dict:
    from vllm import SamplingParams

    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.models.layers import Linear
    from titan_rl.models.options import ModelOptions, Quantization
    from titan_rl.quant_weights import held_bytes, quantized_state, state_bytes, weight_recipes
    from titan_rl.registry import get_architecture
    from titan_rl.vllm.engine import engine_model, make_llm, update_weights

    spec = get_architecture(arch)
    model = spec.build(flavor, ModelOptions(quantization=Quantization(recipe))).init_weights(0).to(torch.bfloat16)
    vocab = model.cfg.vocab_size
    out: dict = {"recipe": recipe}
    g = torch.Generator().manual_seed(0)
    # trainer: forward + backward over [B, L] tokens, the fake-quantized policy
    tokens = torch.randint(2, vocab, (args.train_batch, args.train_len), generator=g)

    def train_step():
        model.zero_grad(set_to_none=True)
        model(tokens).float().logsumexp(-1).mean().backward()

    out["trainer_tokens_per_s"] = tokens.numel() / _time(train_step, args.repeat)
    with torch.no_grad():
        one = tokens[:1]
        out["forward_ms"] = 1e3 * _time(lambda: model(one), args.repeat)
        lins = [m for m in model.modules() if isinstance(m, Linear) and m.recipe is not None]
        if lins:  # the extra work of a quantized forward, measured alone
            held = [m.weight.detach() for m in lins]
            out["weight_fake_quant_ms"] = 1e3 * _time(lambda: [fake_quantize(w, recipe, "weight") for w in held], args.repeat)
            xs = [torch.randn(one.numel(), m.shape[1], generator=g).to(torch.bfloat16) for m in lins if m.quant_input]
            out["act_fake_quant_ms"] = 1e3 * _time(lambda: [fake_quantize(x, recipe, "activation") for x in xs], args.repeat)
    with tempfile.TemporaryDirectory() as d:
        save_hf_folder(model, d, dtype=torch.bfloat16)
        llm = make_llm(d, arch=arch, dtype="bfloat16", kv_cache_mib=128, max_model_len=512,
                       max_num_seqs=args.prompts, enable_prefix_caching=False)
        engine = engine_model(llm)
        out["engine_weight_bytes"] = held_bytes(engine)
        if recipe != "none":
            with torch.no_grad():
                out["engine_dequant_ms"] = 1e3 * _time(
                    lambda: [m.qweight.dense() for m in engine.modules() if getattr(m, "qweight", None) is not None],
                    args.repeat)
        prompts = [torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
        batch = [{"prompt_token_ids": p} for p in prompts]
        n = args.prompts * args.max_tokens
        out["rollout_tokens_per_s"] = n / _time(lambda: llm.generate(batch, params, use_tqdm=False), args.rollout_repeat)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        t0 = time.perf_counter()
        shipped = quantized_state(state, weight_recipes(model))
        update_weights(llm, shipped)
        out["sync_seconds"] = time.perf_counter() - t0
        out["sync_bytes"] = state_bytes(shipped)
        del llm
    return out


COLUMNS = [("engine_weight_bytes", "engine weights", "{:.3g}"), ("sync_bytes", "sync bytes", "{:.3g}"),
           ("rollout_tokens_per_s", "rollout tok/s", "{:.1f}"), ("trainer_tokens_per_s", "trainer tok/s", "{:.0f}"),
           ("forward_ms", "fwd ms (1x L)", "{:.1f}"), ("weight_fake_quant_ms", "W fq ms", "{:.1f}"),
           ("act_fake_quant_ms", "act fq ms", "{:.1f}"), ("engine_dequant_ms", "engine deq ms", "{:.1f}")]
RATIOS = ["engine_weight_bytes", "sync_bytes", "rollout_tokens_per_s", "trainer_tokens_per_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--recipes", default=",".join(QUANT_RECIPES))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--train-len", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per trainer measurement (the fastest counts)")
    ap.add_argument("--rollout-repeat", type=int, default=2, help="timed generate calls per engine (the fastest counts)")
    ap.add_argument("--json", default="outputs/bench_quant.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    recipes = args.recipes.split(",")
    if recipes[0] != "none":
        recipes.insert(0, "none")  # the baseline every ratio divides by
    rows = []
    for r in recipes:
        rows.append(bench(args.arch, args.flavor, r, args))
        print(f"[{r}] done", flush=True)
    base = rows[0]
    for row in rows:
        row["ratio_vs_none"] = {k: row[k] / base[k] for k in RATIOS}
    print(f"\n{args.arch} {args.flavor}, bf16, torch threads {torch.get_num_threads()}")
    print(f"{'recipe':12s}" + "".join(f"{h:>15s}" for _, h, _ in COLUMNS))
    for row in rows:
        print(f"{row['recipe']:12s}" + "".join(
            f"{fmt.format(row[k]) if k in row else '-':>15s}" for k, _, fmt in COLUMNS))
    print(f"\nratio to none{'':1s}" + "".join(f"{k:>22s}" for k in RATIOS))
    for row in rows[1:]:
        print(f"{row['recipe']:14s}" + "".join(f"{row['ratio_vs_none'][k]:>22.3f}" for k in RATIOS))
    # per recipe, the speed ratios to "none" (the unquantized bf16 exact run of this invocation)
    summary = {row["recipe"]: {"rollout_vs_none": row["ratio_vs_none"]["rollout_tokens_per_s"],
                               "trainer_vs_none": row["ratio_vs_none"]["trainer_tokens_per_s"]} for row in rows[1:]}
    write_json(args.json, {**summary, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
