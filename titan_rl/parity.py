"""Parity harness: sample with vLLM, rescore with the trainer-side model, compare.

    python -m titan_rl.parity --config train_configs/debug.toml [--kernels exact|stock|both]
        [--num-prompts N] [--seed S] [--json OUT]

The kernel mode is model.kernels from the config unless --kernels names one, or both.
exact: vLLM runs our registered wrapper (kernels="exact"), the trainer side runs the
       same model definition with the same kernels. Expect max_abs_dlogp == 0.
stock: vLLM runs its built-in implementation of the architecture; the trainer side
       runs our model with plain torch ops (F.linear, SDPA). This is what an RL stack
       without titan_rl sees. Its JSON also reports how far our exact model is from
       vLLM's built-in one on the same sampled tokens (the same function, up to rounding).
Prompts have mixed lengths and requests join a running batch (continuous batching), so
the sampler sees many batch compositions; the trainer rescoring groups the same
sequences into batches of other sizes (parity.trainer_batch_sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict

import torch

from titan_rl import config as config_mod
from titan_rl.jsonout import write_json
from titan_rl.kernels import log_softmax_fp32
from titan_rl.kernels.mode import KERNEL_MODES, KernelMode
from titan_rl.registry import get_architecture

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_weights(cfg: config_mod.Config, workdir: str) -> str:
    """The checkpoint folder both engines load: the configured one, or random weights."""
    from titan_rl.checkpoint import save_hf_folder

    if cfg.model.checkpoint:
        return cfg.model.checkpoint
    spec = get_architecture(cfg.model.name)
    model = spec.build(cfg.model.flavor).init_weights(cfg.model.seed, cfg.model.init_std)
    folder = os.path.join(workdir, "weights")
    save_hf_folder(model, folder, dtype=DTYPES[cfg.model.dtype])
    return folder


def make_prompts(cfg: config_mod.Config, vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    p = cfg.parity
    lens = torch.randint(p.prompt_len_min, p.prompt_len_max + 1, (n,), generator=g)
    return [torch.randint(2, vocab, (int(L),), generator=g).tolist() for L in lens]


def sample(llm, prompts, cfg: config_mod.Config, full_vocab: int, routes: bool = False):
    """Draws come from the engine's seeded RNG (LLM(seed=...)): per-request seeds cannot
    be combined with chunked prefill on vLLM 0.32's CPU runner (it rewinds generators
    with set_offset, which CPU generators lack). routes=True (MoE): also record the
    experts the engine chose for every computed position (titan_rl.vllm.routes)."""
    import contextlib

    from vllm import SamplingParams

    from titan_rl.vllm.routes import capture_routes

    s = cfg.sampling
    params = [
        SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else 0,
                       max_tokens=s.max_tokens, ignore_eos=True,
                       logprobs=-1 if i < full_vocab else 0)
        for i in range(len(prompts))
    ]
    with capture_routes(llm) if routes else contextlib.nullcontext() as rec:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine_routes = rec.assemble(outs) if routes else {}
    samples = []
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        toks = list(c.token_ids)
        mu = [lp[t].logprob for t, lp in zip(toks, c.logprobs)]
        full = None
        if len(c.logprobs[0]) > 1:  # full-vocabulary record
            full = [torch.tensor([d[t].logprob for t in range(len(d))]) for d in c.logprobs]
        samples.append({"prompt": prompt, "tokens": toks, "mu": mu, "full": full,
                        "routes": engine_routes.get(out.request_id)})
    if routes:
        samples[0]["route_bytes_per_token"] = rec.bytes_per_token
    return samples


@torch.no_grad()
def rescore(model, samples, batch_sizes):
    """Trainer-side log-probs of every sampled token (and full rows where recorded),
    with the sequences grouped into batches of varying size, right-padded."""
    i, k = 0, 0
    while i < len(samples):
        group = samples[i : i + batch_sizes[k % len(batch_sizes)]]
        i, k = i + len(group), k + 1
        seqs = [s["prompt"] + s["tokens"] for s in group]
        L = max(map(len, seqs))
        batch = torch.zeros(len(seqs), L, dtype=torch.long)
        for r, seq in enumerate(seqs):
            batch[r, : len(seq)] = torch.tensor(seq)
        logp = log_softmax_fp32(model(batch))
        own = getattr(model, "last_own_routes", None)  # MoE: the trainer router's choice
        own = torch.stack(own, 1).view(len(seqs), L, len(own), -1) if own else None
        for r, s in enumerate(group):
            P, T = len(s["prompt"]), len(s["tokens"])
            if own is not None:
                s["trainer_routes"] = own[r, : P + T - 1]
            rows = logp[r, P - 1 : P - 1 + T]
            s["pi"] = rows.gather(-1, torch.tensor(s["tokens"])[:, None])[:, 0].tolist()
            s["entropy"] = (-(rows.exp() * rows).nansum(-1)).tolist()  # trainer's, at each position
            if s["full"] is not None:
                s["pi_full"] = rows.clone()


def detail(samples) -> dict:
    """Per-token arrays for the report (titan_rl.report): log ratio, both log-probs, the
    token's index in its completion and the trainer's entropy there."""
    return {
        "log_ratio": [p - m for s in samples for p, m in zip(s["pi"], s["mu"])],
        "pi": [p for s in samples for p in s["pi"]],
        "mu": [m for s in samples for m in s["mu"]],
        "position": [i for s in samples for i in range(len(s["mu"]))],
        "entropy": [e for s in samples for e in s["entropy"]],
    }


def expert_disagreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Routes [N, layers, k] from two sides -> the fraction of (position, layer, slot)
    choices of `a` that are not among `b`'s k experts there (order-free)."""
    if a.shape != b.shape:
        raise ValueError(f"route shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    hit = (a.long()[..., :, None] == b.long()[..., None, :]).any(-1)
    return float(1.0 - hit.double().mean())


def compare(samples, key_pi="pi") -> dict:
    mu = torch.tensor([m for s in samples for m in s["mu"]], dtype=torch.float64)
    pi = torch.tensor([p for s in samples for p in s[key_pi]], dtype=torch.float64)
    d = pi - mu
    k3 = torch.exp(d) - d - 1  # rho - log(rho) - 1 with rho = pi/mu
    out = {
        "tokens": int(mu.numel()),
        "bitwise_fraction": float((d == 0).double().mean()),
        "max_abs_dlogp": float(d.abs().max()),
        "mean_abs_dlogp": float(d.abs().mean()),
        "k3_mean": float(k3.mean()),
        "k3_max": float(k3.max()),
    }
    fulls = [(s["pi_full"], torch.stack(s["full"])) for s in samples if s.get("pi_full") is not None]
    if fulls:
        dd = torch.cat([(a.double() - b.double()).abs().flatten() for a, b in fulls])
        out["full_vocab_positions"] = sum(a.shape[0] for a, _ in fulls)
        out["full_vocab_max_abs_dlogp"] = float(dd.max())
        out["full_vocab_bitwise_fraction"] = float((dd == 0).double().mean())
    if samples and samples[0].get("routes") is not None and "trainer_routes" in samples[0]:
        eng = torch.cat([s["routes"] for s in samples])
        out["routed_positions"] = int(eng.shape[0])
        out["expert_disagreement"] = expert_disagreement(eng, torch.cat([s["trainer_routes"] for s in samples]))
        out["route_bytes_per_token"] = samples[0]["route_bytes_per_token"]
    return out


def spec_config(cfg, folder):
    with open(os.path.join(folder, "config.json")) as f:
        return get_architecture(cfg.model.name).config_from_hf(json.load(f))


def run_engine(cfg, folder, kernels: KernelMode, prompts, seed: int, progress=print,
               with_detail: bool = False) -> dict:
    from titan_rl.checkpoint import load_hf_folder
    from titan_rl.vllm.engine import make_llm

    r = cfg.rollout
    t0 = time.perf_counter()
    llm = make_llm(folder, arch=cfg.model.name, kernels=kernels, dtype=cfg.model.dtype, seed=seed,
                   kv_cache_mib=r.kv_cache_mib, max_model_len=r.max_model_len, max_num_seqs=r.max_num_seqs,
                   max_num_batched_tokens=r.max_num_batched_tokens or None,
                   enable_prefix_caching=r.enable_prefix_caching)
    progress(f"[{kernels}] engine ready in {time.perf_counter() - t0:.1f}s; sampling {len(prompts)} prompts")
    t0 = time.perf_counter()
    samples = sample(llm, prompts, cfg, cfg.parity.full_vocab_prompts, routes=get_architecture(cfg.model.name).moe)
    t_roll = time.perf_counter() - t0
    progress(f"[{kernels}] sampled {sum(len(s['tokens']) for s in samples)} tokens in {t_roll:.1f}s; rescoring")
    dtype = DTYPES[cfg.model.dtype]
    if kernels == "exact":
        from titan_rl.kernels.selfcheck import check_platform

        check_platform(dtype, head_dim=getattr(spec_config(cfg, folder), "head_dim", 128))
    trainer = load_hf_folder(folder, kernels=kernels, dtype=dtype, arch=cfg.model.name).eval()
    rescore(trainer, samples, cfg.parity.trainer_batch_sizes)
    result = {"engine": kernels, **compare(samples)}
    if with_detail:
        result.update(detail(samples))
    if kernels == "stock":  # how far is our (exact) model from vLLM's built-in one?
        ours = load_hf_folder(folder, kernels="exact", dtype=dtype, arch=cfg.model.name).eval()
        for s in samples:
            s["pi_stock"] = s.pop("pi")
            s.pop("pi_full", None)
            s.pop("trainer_routes", None)
        rescore(ours, samples, cfg.parity.trainer_batch_sizes)
        unified = compare(samples)
        result["unified_vs_builtin_max_abs_dlogp"] = unified["max_abs_dlogp"]
        result["unified_vs_builtin_mean_abs_dlogp"] = unified["mean_abs_dlogp"]
    result["rollout_seconds"] = round(t_roll, 3)
    del llm
    return result


def print_table(results: list[dict], file=None) -> None:
    file = sys.stdout if file is None else file  # looked up at call time (capture, redirection)
    keys = ["tokens", "bitwise_fraction", "max_abs_dlogp", "mean_abs_dlogp", "k3_mean", "k3_max",
            "full_vocab_max_abs_dlogp", "expert_disagreement", "route_bytes_per_token",
            "unified_vs_builtin_max_abs_dlogp"]
    print(f"{'metric':34s}" + "".join(f"{r['engine']:>14s}" for r in results), file=file)
    for k in keys:
        if not any(k in r for r in results):
            continue
        cells = []
        for r in results:
            v = r.get(k)
            cells.append(f"{'-':>14s}" if v is None else f"{v:>14d}" if isinstance(v, int) else f"{v:>14.4g}")
        print(f"{k:34s}" + "".join(cells), file=file)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_rl.parity", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--kernels", choices=[*KERNEL_MODES, "both"], default=None,
                    help="the kernel mode(s) to run; default: model.kernels from the config")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--detail", action="store_true",
                    help="also store per-token arrays in the JSON (for python -m titan_rl.report)")
    ap.add_argument("overrides", nargs="*", help="--section.key=value")
    args, extra = ap.parse_known_args(argv)
    from titan_rl import validation as v

    try:
        # a misspelt option lands in `extra` and its value among the overrides: name the option
        v.check_cli_overrides(extra + list(args.overrides),
                              [o for a in ap._actions for o in a.option_strings if o.startswith("--")])
        cfg = config_mod.load(args.config, list(args.overrides) + extra)
        config_mod.validate_parity(cfg)
        if args.num_prompts is not None and args.num_prompts < 1:
            raise v.UserError(f"--num-prompts = {args.num_prompts}: must be >= 1")
        if cfg.model.checkpoint:  # strictly, before vLLM's loader (its errors name no file)
            from titan_rl.checkpoint import check_hf_folder

            check_hf_folder(cfg.model.checkpoint, arch=cfg.model.name)
    except v.USER_ERRORS as e:
        return v.report_error(e, "config error" if isinstance(e, config_mod.ConfigError) else "error")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    seed = cfg.parity.seed if args.seed is None else args.seed
    n = cfg.parity.num_prompts if args.num_prompts is None else args.num_prompts
    chosen = args.kernels or cfg.model.kernels
    modes = list(KERNEL_MODES) if chosen == "both" else [chosen]
    with tempfile.TemporaryDirectory() as work:
        folder = build_weights(cfg, work)
        vocab = spec_config(cfg, folder).vocab_size
        prompts = make_prompts(cfg, vocab, n, seed)
        results = [run_engine(cfg, folder, k, prompts, seed, with_detail=args.detail) for k in modes]
    print_table(results)
    doc = {"config": asdict(cfg), "seed": seed, "num_prompts": n, "results": results,
           **{k: v for k, v in results[0].items()}}
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
