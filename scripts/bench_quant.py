"""What each quantization recipe costs and saves, against the same model unquantized, in
one run (so the ratios compare like with like): engine weight bytes, weight-sync bytes,
rollout tokens/s (vLLM, our wrapper) and trainer tokens/s (forward + backward), plus where
a quantized forward's extra time goes (weight dequantization, activation fake-quant).

    python scripts/bench_quant.py [--flavor debug] [--recipes none,fp8_rowwise,...] [--json OUT]

Every recipe's trainer model and engine are built first, then timed in interleaved rounds
(trainer steps, then generate calls: each round runs every recipe in turn, an untimed call then
a timed one; the fastest per recipe counts), so the ratios compare measurements from the same
stretches of machine load.

CPU: fp8_rowwise, nvfp4 and nvfp4_w4a4 run the quantized GEMM on AVX512-BF16 (the engine reads
the packed payload; docs/quantization.md), the other recipes the dense form (the engine
dequantizes each payload once per load, then the invariant bf16 GEMM; inputs are
fake-quantized per call). "W fq ms" / "act fq ms" time the dense form's fake quantization of
all weights / of one forward's inputs, "engine deq ms" dequantizing all held weights.
"""

from __future__ import annotations

import argparse
import os
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


def _interleaved(fns: dict, rounds: int) -> tuple[dict, dict]:
    """({name: fastest call}, {name: least process CPU time of a call}) over `rounds` rounds,
    each running every fn in turn: the recipes' times come from the same stretches of machine
    load, so their ratios hold on a machine shared with other jobs, where one recipe timed after
    another may meet another load (measured on 2 shared cores: 'none' alone 130 then 253 tok/s
    in two runs). In its turn a fn runs once untimed, then once timed, as in a run where steps
    follow steps of the same recipe: timed right after another recipe's calls (torchao's
    compositions allocate differently), the trainer steps of the six recipes measured 0.83-0.93x
    against 1.00x with three. The CPU time (all of the process's threads) is not stretched by
    other jobs taking the core: reported beside the wall-clock figures, which stay the
    benchmark's."""
    best, cpu = dict.fromkeys(fns, float("inf")), dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    return best, cpu


class Setup:
    """One recipe's trainer model and engine, built before any timing (all recipes are then
    timed round by round, `_interleaved`)."""

    def __init__(self, arch: str, flavor: str, recipe: str, args, folder: str):
        from vllm import SamplingParams

        from titan_rl.checkpoint import save_hf_folder
        from titan_rl.models.options import ModelOptions, Quantization
        from titan_rl.registry import get_architecture
        from titan_rl.vllm.engine import EngineSettings, make_llm

        self.recipe, self.arch = recipe, arch
        spec = get_architecture(arch)
        self.model = spec.build(flavor, ModelOptions(quantization=Quantization(recipe))).init_weights(0).to(torch.bfloat16)
        vocab = self.model.cfg.vocab_size
        g = torch.Generator().manual_seed(0)
        # trainer: forward + backward over [B, L] tokens, the fake-quantized policy
        self.tokens = torch.randint(2, vocab, (args.train_batch, args.train_len), generator=g)
        save_hf_folder(self.model, folder, dtype=torch.bfloat16)
        self.llm = make_llm(folder, EngineSettings(arch=arch, dtype="bfloat16", kv_cache_mib=128, max_model_len=512,
                                                   max_num_seqs=args.prompts, enable_prefix_caching=False))
        prompts = [torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
        self.params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
        self.batch = [{"prompt_token_ids": p} for p in prompts]

    def train_step(self):
        self.model.zero_grad(set_to_none=True)
        self.model(self.tokens).float().logsumexp(-1).mean().backward()

    def rollout(self):
        self.llm.generate(self.batch, self.params, use_tqdm=False)

    def details(self, args) -> dict:
        """What one recipe costs and saves apart from the speeds (timed alone: no ratio)."""
        from titan_rl.models.layers import Linear
        from titan_rl.quant_weights import held_bytes, quantized_state, state_bytes, weight_recipes
        from titan_rl.vllm.engine import engine_model, update_weights

        out: dict = {"recipe": self.recipe}
        recipe, g = self.recipe, torch.Generator().manual_seed(1)
        with torch.no_grad():
            one = self.tokens[:1]
            out["forward_ms"] = 1e3 * _time(lambda: self.model(one), args.repeat)
            lins = [m for m in self.model.modules() if isinstance(m, Linear) and m.recipe is not None]
            if lins:  # the extra work of a quantized forward in the dense form, measured alone
                held = [m.weight.detach() for m in lins]
                out["weight_fake_quant_ms"] = 1e3 * _time(lambda: [fake_quantize(w, recipe, "weight") for w in held],
                                                          args.repeat)
                xs = [torch.randn(one.numel(), m.shape[1], generator=g).to(torch.bfloat16) for m in lins if m.quant_input]
                out["act_fake_quant_ms"] = 1e3 * _time(lambda: [fake_quantize(x, recipe, "activation") for x in xs],
                                                       args.repeat)
        engine = engine_model(self.llm)
        out["engine_weight_bytes"] = held_bytes(engine)
        if recipe != "none":
            with torch.no_grad():
                out["engine_dequant_ms"] = 1e3 * _time(
                    lambda: [m.qweight.dense() for m in engine.modules() if getattr(m, "qweight", None) is not None],
                    args.repeat)
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        t0 = time.perf_counter()
        shipped = quantized_state(state, weight_recipes(self.model))
        update_weights(self.llm, shipped)
        out["sync_seconds"] = time.perf_counter() - t0
        out["sync_bytes"] = state_bytes(shipped)
        return out


COLUMNS = [("engine_weight_bytes", "engine weights", "{:.3g}"), ("sync_bytes", "sync bytes", "{:.3g}"),
           ("rollout_tokens_per_s", "rollout tok/s", "{:.1f}"), ("trainer_tokens_per_s", "trainer tok/s", "{:.0f}"),
           ("forward_ms", "fwd ms (1x L)", "{:.1f}"), ("weight_fake_quant_ms", "W fq ms", "{:.1f}"),
           ("act_fake_quant_ms", "act fq ms", "{:.1f}"), ("engine_dequant_ms", "engine deq ms", "{:.1f}")]
RATIOS = ["engine_weight_bytes", "sync_bytes", "rollout_tokens_per_s", "trainer_tokens_per_s",
          "rollout_tokens_per_cpu_s", "trainer_tokens_per_cpu_s"]


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
    ap.add_argument("--repeat", type=int, default=5,
                    help="interleaved rounds of trainer steps, one timed per recipe each (the fastest counts)")
    ap.add_argument("--rollout-repeat", type=int, default=4,
                    help="interleaved rounds of generate calls, one timed per engine each (the fastest counts)")
    ap.add_argument("--json", default="outputs/bench_quant.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    recipes = args.recipes.split(",")
    if recipes[0] != "none":
        recipes.insert(0, "none")  # the baseline every ratio divides by
    with tempfile.TemporaryDirectory() as d:
        setups = [Setup(args.arch, args.flavor, r, args, os.path.join(d, r)) for r in recipes]
        print(f"[built] {', '.join(recipes)}; timing them in interleaved rounds", flush=True)
        train, train_cpu = _interleaved({s.recipe: s.train_step for s in setups}, args.repeat)
        roll, roll_cpu = _interleaved({s.recipe: s.rollout for s in setups}, args.rollout_repeat)
        rows = []
        for s in setups:
            row = s.details(args)
            row["trainer_tokens_per_s"] = s.tokens.numel() / train[s.recipe]
            row["rollout_tokens_per_s"] = args.prompts * args.max_tokens / roll[s.recipe]
            row["trainer_tokens_per_cpu_s"] = s.tokens.numel() / train_cpu[s.recipe]
            row["rollout_tokens_per_cpu_s"] = args.prompts * args.max_tokens / roll_cpu[s.recipe]
            rows.append(row)
            print(f"[{s.recipe}] done", flush=True)
        del setups
    base = rows[0]
    for row in rows:
        row["ratio_vs_none"] = {k: row[k] / base[k] for k in RATIOS}
    print(f"\n{args.arch} {args.flavor}, bf16, torch threads {torch.get_num_threads()}")
    print(f"{'recipe':12s}" + "".join(f"{h:>15s}" for _, h, _ in COLUMNS))
    for row in rows:
        print(f"{row['recipe']:12s}" + "".join(
            f"{fmt.format(row[k]) if k in row else '-':>15s}" for k, _, fmt in COLUMNS))
    print(f"\nratio to none{'':1s}" + "".join(f"{k:>26s}" for k in RATIOS))
    for row in rows[1:]:
        print(f"{row['recipe']:14s}" + "".join(f"{row['ratio_vs_none'][k]:>26.3f}" for k in RATIOS))
    # per recipe, the speed ratios to "none" (the unquantized bf16 exact run of this invocation)
    summary = {row["recipe"]: {"rollout_vs_none": row["ratio_vs_none"]["rollout_tokens_per_s"],
                               "trainer_vs_none": row["ratio_vs_none"]["trainer_tokens_per_s"],
                               "rollout_vs_none_cpu": row["ratio_vs_none"]["rollout_tokens_per_cpu_s"],
                               "trainer_vs_none_cpu": row["ratio_vs_none"]["trainer_tokens_per_cpu_s"]}
               for row in rows[1:]}
    write_json(args.json, {**summary, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
