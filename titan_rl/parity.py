"""Parity harness: sample with vLLM, rescore with the trainer-side model, compare.

    python -m titan_rl.parity --config train_configs/debug.toml [--kernels exact|stock|both]
        [--num-prompts N] [--seed S] [--json OUT]

The kernel mode is model.kernels from the config unless --kernels names one, or both.
With parity.episodes = N the engines play N episodes of the config's [task] instead of
random prompts (titan_rl.rl.episodes: a multi-turn environment's whole conversations,
token in and token out, later turns on the prefix cache) and every sampled token of every
turn is rescored; --detail then also records each token's turn and position in its reply.
exact: vLLM runs our registered wrapper (kernels="exact"), the trainer side runs the
       same model definition with the same kernels. Expect max_abs_dlogp == 0.
stock: vLLM runs its built-in implementation of the architecture; the trainer side
       runs our model with plain torch ops (F.linear, SDPA). This is what an RL stack
       without titan_rl sees. Its JSON also reports how far our exact model is from
       vLLM's built-in one on the same sampled tokens (the same function, up to rounding).
Prompts have mixed lengths and requests join a running batch (continuous batching), so
the sampler sees many batch compositions; the trainer rescoring groups the same
sequences into batches of other sizes (parity.trainer_batch_sizes). Each engine result
carries the execution contract of both sides (titan_rl.contract: hash, entries, the
entries that differ).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from titan_rl import quiet

quiet.install()  # before torch, torchao and vLLM load: their known-harmless notices stay off the console

import torch

from titan_rl import config as config_mod
from titan_rl.jsonout import write_json
from titan_rl.kernels import log_softmax_fp32
from titan_rl.kernels.mode import KERNEL_MODES, KernelMode
from titan_rl.dtypes import DTYPES
from titan_rl.kernels.quant.recipes import check_stock_recipe
from titan_rl.models.common import choice_points
from titan_rl.models.options import ModelOptions, Quantization
from titan_rl.metrics import expert_disagreement, full_vocab_mismatch, index_disagreement, logprob_mismatch
from titan_rl.registry import get_architecture
from titan_rl.rollout import Rollout



def build_weights(cfg: config_mod.Config, workdir: str) -> str:
    """The checkpoint folder both engines load: the configured one, or random weights.
    A quantization recipe travels in its config.json ("titan_quantization"): a configured
    folder is then linked into `workdir` with that key added."""
    from titan_rl.checkpoint import CONFIG_NAME, save_hf_folder

    q = cfg.quantization
    options = ModelOptions(quantization=Quantization(q.recipe, tuple(q.layers)))
    folder = os.path.join(workdir, "weights")
    if cfg.model.checkpoint:
        if q.recipe == "none":
            return cfg.model.checkpoint
        os.makedirs(folder)
        for name in os.listdir(cfg.model.checkpoint):
            if name != CONFIG_NAME:
                os.symlink(os.path.abspath(os.path.join(cfg.model.checkpoint, name)), os.path.join(folder, name))
        with open(os.path.join(cfg.model.checkpoint, CONFIG_NAME)) as f:
            hf = json.load(f)
        hf.update(options.to_hf())
        write_json(os.path.join(folder, CONFIG_NAME), hf)
        return folder
    spec = get_architecture(cfg.model.name)
    model = spec.build(cfg.model.flavor, options).init_weights(cfg.model.seed, cfg.model.init_std)
    save_hf_folder(model, folder, dtype=DTYPES[cfg.model.dtype])
    return folder


def make_prompts(cfg: config_mod.Config, vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    p = cfg.parity
    lens = torch.randint(p.prompt_len_min, p.prompt_len_max + 1, (n,), generator=g)
    return [torch.randint(2, vocab, (int(L),), generator=g).tolist() for L in lens]


def sample(llm, prompts, cfg: config_mod.Config, full_vocab: int, routes: bool = False, indices: bool = False
           ) -> Rollout:
    """Draws come from the engine's seeded RNG (LLM(seed=...)): per-request seeds cannot
    be combined with chunked prefill on vLLM 0.32's CPU runner (it rewinds generators
    with set_offset, which CPU generators lack). The first `full_vocab` prompts record
    every token's log-prob. routes=True (MoE): also record the experts the engine chose
    for every computed position (titan_rl.vllm.routes); indices=True (sparse attention): the
    key positions each indexer layer selected (titan_rl.vllm.indices)."""
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
    with contextlib.ExitStack() as stack:
        rec = stack.enter_context(capture_routes(llm)) if routes else None
        idx = None
        if indices:
            from titan_rl.vllm.indices import capture_indices

            idx = stack.enter_context(capture_indices(llm))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return Rollout.from_vllm(outs, routes=rec, indices=idx)


def play(llm, cfg: config_mod.Config, env, n: int, seed: int, full_vocab: int, routes: bool = False,
         indices: bool = False) -> Rollout:
    """n episodes of `env` (one per start of env.starts(n, seed)), each seeded by its index,
    played on `llm` to their end; the first `full_vocab` record every token's log-prob."""
    import contextlib

    from vllm import SamplingParams

    from titan_rl.rl.episodes import EpisodeRequest, EpisodeRun
    from titan_rl.rl.requests import stop_ids
    from titan_rl.vllm.routes import capture_routes

    s = cfg.sampling
    episodes = [EpisodeRequest(i, start, SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else 0, max_tokens=env.max_new_tokens,
        stop_token_ids=stop_ids(env.tokenizer), seed=seed * 100_003 + i, logprobs=-1 if i < full_vocab else 0))
        for i, start in enumerate(env.starts(n, seed))]
    run = EpisodeRun(env, episodes, max_model_len=cfg.rollout.max_model_len, workers=cfg.rollout.env_workers)
    with contextlib.ExitStack() as stack:
        rec = stack.enter_context(capture_routes(llm)) if routes else None
        idx = None
        if indices:
            from titan_rl.vllm.indices import capture_indices

            idx = stack.enter_context(capture_indices(llm))
        run.run(lambda prompts, params: llm.generate(prompts, params, use_tqdm=False))
    return run.rollout(routes=rec, indices=idx)


@dataclass
class Scores:
    """The trainer side's view of a Rollout, one entry per request (R_i sampled tokens, P_i prompt tokens)."""

    pi: list[torch.Tensor]  # float32 [R_i]: log pi of each sampled token
    entropy: list[torch.Tensor]  # float32 [R_i]: the trainer's entropy at each of those positions
    full: list[torch.Tensor | None]  # float32 [R_i, V]: full log-prob rows where the rollout has the sampler's
    routes: list[torch.Tensor] | None  # MoE: the trainer router's experts [P_i + R_i - 1, layers, k]
    # sparse attention: the trainer indexers' own key sets [P_i + R_i - 1, layers, topk]
    indices: list[torch.Tensor] | None = None


@torch.no_grad()
def rescore(model, rollout: Rollout, batch_sizes: list[int], replay_indices: bool = False) -> Scores:
    """Trainer-side log-probs of every sampled token (and full rows where recorded),
    with the sequences grouped into batches of varying size, right-padded. replay_indices
    (sparse attention, rollout.index_selection = "replay"): the trainer attends to exactly the
    key sets the engine recorded; otherwise its indexers choose (pinned)."""
    scores = Scores(pi=[], entropy=[], full=[], routes=[], indices=[])
    recorded = rollout.padded_indices() if replay_indices and rollout.indices is not None else None
    i, k = 0, 0
    while i < len(rollout):
        rows = range(i, min(i + batch_sizes[k % len(batch_sizes)], len(rollout)))
        i, k = rows.stop, k + 1
        batch = rollout.batch(0, rows)
        if recorded is not None:
            forced = recorded[rows.start:rows.stop, : batch.shape[1]]
            flat = forced.reshape(-1, *forced.shape[2:])
            choice_points.force(model, "indices", [flat[:, layer] for layer in range(flat.shape[1])])
        logp = log_softmax_fp32(model(batch))
        if recorded is not None:
            choice_points.force(model, "indices", None)
        own = choice_points.own(model, "routes")  # MoE: the trainer router's choice
        own = torch.stack(own, 1).view(*batch.shape, len(own), -1) if own else None
        own_sets = choice_points.own(model, "indices")  # sparse attention: the trainer indexers' choice
        own_sets = torch.stack(own_sets, 1).view(*batch.shape, len(own_sets), -1) if own_sets else None
        for r, j in enumerate(rows):
            lp, toks = logp[r, rollout.response_span(j)], torch.tensor(rollout.tokens[j], dtype=torch.long)
            if rollout.sampled is not None:  # an episode's row: only the engine's tokens, not the context
                lp, toks = lp[rollout.sampled[j]], toks[rollout.sampled[j]]
            scores.pi.append(lp.gather(-1, toks[:, None])[:, 0])
            scores.entropy.append(-(lp.exp() * lp).nansum(-1))
            scores.full.append(lp.clone() if rollout.full[j] is not None else None)
            n = len(rollout.prompts[j]) + len(rollout.tokens[j]) - 1
            if own is not None:
                scores.routes.append(own[r, :n])
            if own_sets is not None:
                scores.indices.append(own_sets[r, :n])
    if not scores.routes:
        scores.routes = None
    if not scores.indices:
        scores.indices = None
    return scores


def detail(rollout: Rollout, scores: Scores) -> dict:
    """Per-token arrays for the report (titan_rl.report): log ratio, both log-probs, the
    token's index in its completion and the trainer's entropy there."""
    mu = rollout.mu if rollout.sampled is None else [m[s] for m, s in zip(rollout.mu, rollout.sampled)]
    pi, mu = torch.cat(scores.pi).tolist(), torch.cat(mu).tolist()
    out = {
        "log_ratio": [p - m for p, m in zip(pi, mu)],
        "pi": pi,
        "mu": mu,
        "position": [i for toks in rollout.tokens for i in range(len(toks))],
        "entropy": torch.cat(scores.entropy).tolist(),
    }
    if rollout.episodes is not None:  # episodes: the turn of each token and its position in that reply
        turns = [e.turn_positions() for e in rollout.episodes]
        out["turn"] = [t for ts, _ in turns for t in ts]
        out["position"] = [k for _, ks in turns for k in ks]
    return out


def compare(rollout: Rollout, scores: Scores, index_selection: str = "pinned") -> dict:
    """The parity JSON's statistics (titan_rl.metrics): sampled-token log-probs, full rows
    where recorded, for MoE the experts, for sparse attention the selected key sets (and the
    bytes per token the mode ships: the record under replay, 0 pinned)."""
    mu = rollout.mu if rollout.sampled is None else [m[s] for m, s in zip(rollout.mu, rollout.sampled)]
    out = logprob_mismatch(torch.cat(scores.pi), torch.cat(mu))
    if rollout.episodes is not None:
        firsts = [e for e in rollout.episodes if e.part == 0]
        out.update(episodes=len(firsts), turns_per_episode=sum(e.turns for e in firsts) / max(len(firsts), 1),
                   prefix_cached_tokens=sum(e.cached_tokens for e in firsts),
                   render_breaks=sum(e.render_breaks for e in firsts),
                   rerender_divergence=sum(e.rerender_diverged for e in firsts))
    fulls = [(a, b) for a, b in zip(scores.full, rollout.full) if a is not None]
    if fulls:
        out.update(full_vocab_mismatch(fulls))
    if rollout.routes is not None and scores.routes is not None:
        eng = torch.cat(rollout.routes)
        out["routed_positions"] = int(eng.shape[0])
        out["expert_disagreement"] = expert_disagreement(eng, torch.cat(scores.routes))
        out["route_bytes_per_token"] = rollout.route_bytes_per_token
    if rollout.indices is not None and scores.indices is not None:
        eng = torch.cat(rollout.indices)
        out["index_selection"] = index_selection
        out["indexed_positions"] = int(eng.shape[0])
        out["index_disagreement"] = index_disagreement(eng, torch.cat(scores.indices))
        out["index_bytes_per_token"] = rollout.index_bytes_per_token if index_selection == "replay" else 0
        out["index_record_bytes_per_token"] = rollout.index_bytes_per_token
    return out


def contracts(trainer, llm) -> dict:
    """Both sides' execution contracts (titan_rl.contract) and the entries that differ:
    recorded, not refused, since parity is where a mismatch is measured."""
    from titan_rl.contract import contract_of, diff
    from titan_rl.vllm.engine_contract import engine_contract

    mine, engine = contract_of(trainer), engine_contract(llm)
    return {"trainer": mine.record(), "engine": engine.record(), "differs": diff(mine, engine)}


def spec_config(cfg, folder):
    with open(os.path.join(folder, "config.json")) as f:
        return get_architecture(cfg.model.name).config_from_hf(json.load(f))


def run_transformers_pair(cfg, folder, prompts, seed: int, reason: str, progress=print,
                          with_detail: bool = False) -> dict:
    """The stock column where vLLM's CPU ops cannot run the folder (titan_rl.stock_pair)."""
    from titan_rl.stock_pair import sample_and_rescore

    progress(f"[stock] vLLM's built-in CPU ops cannot run this folder ({reason}): the stock pair is "
             f"transformers' cached decode (sampler) vs its full forward (trainer); sampling {len(prompts)} prompts")
    t0 = time.perf_counter()
    rollout, sides = sample_and_rescore(folder, cfg, prompts, seed, cfg.parity.full_vocab_prompts,
                                        replay_indices=cfg.rollout.index_selection == "replay")
    scores = Scores(**{"routes": None, **sides})
    result = {"engine": "stock", "stock_source": f"transformers decode vs forward: {reason}",
              **compare(rollout, scores, cfg.rollout.index_selection)}
    if with_detail:
        result.update(detail(rollout, scores))
    result["rollout_seconds"] = round(time.perf_counter() - t0, 3)
    return result


def run_engine(cfg, folder, kernels: KernelMode, prompts, seed: int, progress=print,
               with_detail: bool = False, env=None) -> dict:
    """One engine's column: sample `prompts` (or, with `env`, play cfg.parity.episodes of its
    episodes), rescore on the trainer side, compare."""
    from titan_rl.checkpoint import load_hf_folder
    from titan_rl.vllm.engine import EngineSettings, make_llm

    t0 = time.perf_counter()
    llm = make_llm(folder, EngineSettings.from_config(cfg, kernels=kernels, seed=seed))
    what = f"playing {cfg.parity.episodes} episodes" if env is not None else f"sampling {len(prompts)} prompts"
    progress(f"[{kernels}] engine ready in {time.perf_counter() - t0:.1f}s; {what}")
    t0 = time.perf_counter()
    spec = get_architecture(cfg.model.name)
    capture = dict(routes=spec.moe, indices=spec.sparse_attention and kernels == "exact")
    rollout = play(llm, cfg, env, cfg.parity.episodes, seed, cfg.parity.full_vocab_prompts, **capture) \
        if env is not None else sample(llm, prompts, cfg, cfg.parity.full_vocab_prompts, **capture)
    t_roll = time.perf_counter() - t0
    progress(f"[{kernels}] sampled {rollout.num_tokens} tokens in {t_roll:.1f}s; rescoring")
    dtype = DTYPES[cfg.model.dtype]
    if kernels == "exact":
        from titan_rl.kernels.selfcheck import check_platform

        check_platform(dtype, head_dim=getattr(spec_config(cfg, folder), "head_dim", 128))
    trainer = load_hf_folder(folder, kernels=kernels, dtype=dtype, arch=cfg.model.name).eval()
    replay = cfg.rollout.index_selection == "replay"
    scores = rescore(trainer, rollout, cfg.parity.trainer_batch_sizes, replay_indices=replay)
    result = {"engine": kernels, **compare(rollout, scores, cfg.rollout.index_selection),
              "contract": contracts(trainer, llm)}
    differs = result["contract"]["differs"]
    progress(f"[{kernels}] execution contract: " + (f"differs in {', '.join(differs)}" if differs else "equal"))
    if with_detail:
        result.update(detail(rollout, scores))
    if kernels == "stock":  # how far is our (exact) model from vLLM's built-in one?
        ours = load_hf_folder(folder, kernels="exact", dtype=dtype, arch=cfg.model.name).eval()
        unified = compare(rollout, rescore(ours, rollout, cfg.parity.trainer_batch_sizes))
        result["unified_vs_builtin_max_abs_dlogp"] = unified["max_abs_dlogp"]
        result["unified_vs_builtin_mean_abs_dlogp"] = unified["mean_abs_dlogp"]
    result["rollout_seconds"] = round(t_roll, 3)
    del llm
    return result


def print_table(results: list[dict], file=None) -> None:
    file = sys.stdout if file is None else file  # looked up at call time (capture, redirection)
    keys = ["episodes", "turns_per_episode", "prefix_cached_tokens", "tokens", "bitwise_fraction", "max_abs_dlogp",
            "mean_abs_dlogp", "k3_mean", "k3_max",
            "full_vocab_max_abs_dlogp", "expert_disagreement", "route_bytes_per_token", "index_disagreement",
            "index_bytes_per_token", "unified_vs_builtin_max_abs_dlogp"]
    print(f"{'metric':34s}" + "".join(f"{r['engine']:>14s}" for r in results), file=file)
    for k in keys:
        if not any(k in r for r in results):
            continue
        cells = []
        for r in results:
            v = r.get(k)
            cells.append(f"{'-':>14s}" if v is None else f"{v:>14d}" if isinstance(v, int) else f"{v:>14.4g}")
        print(f"{k:34s}" + "".join(cells), file=file)


def _stock_fallback(cfg) -> str:
    """Why the stock column cannot be vLLM's own model ("" when it can). vLLM's CPU ops take
    only some shapes and dtypes (titan_rl.vllm.stock_cpu.stock_cpu_problem); for a checkpoint
    folder transformers can run, its own prefill/decode pair is the stock column then
    (titan_rl.stock_pair), and without a folder the run is refused here, before any engine
    starts."""
    from titan_rl.errors import ConfigError
    from titan_rl.vllm.stock_cpu import stock_cpu_problem

    spec = get_architecture(cfg.model.name)
    if spec.hf_architecture == spec.vllm_architecture:
        raise ConfigError(f"--kernels stock for model.name {cfg.model.name!r}: vLLM has no built-in implementation of "
                          "it (its HF architecture is our own wrapper); use --kernels exact")
    arch_cfg = config_mod.model_config(cfg)
    problem = arch_cfg is not None and stock_cpu_problem(spec, arch_cfg, cfg.model.dtype)
    if problem and not cfg.model.checkpoint:
        raise ConfigError(f"--kernels stock for model.name {cfg.model.name!r} (model.flavor {cfg.model.flavor!r}): "
                          f"vLLM's built-in CPU ops cannot run it: {problem}; use --kernels exact, or a "
                          "model.checkpoint folder (then transformers' own decode-vs-forward pair is the stock column)")
    return problem or ""


def _episodes_env(cfg, fallback: str):
    """The environment parity.episodes plays ([task], checked as a run's), or None."""
    if cfg.parity.episodes <= 0:
        return None
    from titan_rl.errors import ConfigError
    from titan_rl.tasks import as_environment
    from titan_rl.validation import load_task_checked

    if fallback:
        raise ConfigError(f"parity.episodes = {cfg.parity.episodes} with a stock column from transformers ({fallback}): "
                          "episodes run on vLLM engines only; use --kernels exact, or parity.episodes = 0")
    env = as_environment(load_task_checked(cfg))
    vocab = config_mod.model_config(cfg)
    if vocab is not None and env.tokenizer.vocab_size > vocab.vocab_size:
        raise ConfigError(f"task {cfg.task.name!r} needs {env.tokenizer.vocab_size} token ids; the model's vocab_size "
                          f"is {vocab.vocab_size}")
    return env


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
    from titan_rl.errors import ConfigError, UserError, report_error

    try:
        # a misspelt option lands in `extra` and its value among the overrides: name the option
        v.check_cli_overrides(extra + list(args.overrides),
                              [o for a in ap._actions for o in a.option_strings if o.startswith("--")])
        cfg = config_mod.load(args.config, list(args.overrides) + extra)
        config_mod.validate_parity(cfg)
        chosen = args.kernels or cfg.model.kernels
        if chosen in ("stock", "both"):
            try:
                check_stock_recipe(cfg.quantization.recipe, kernels_key=f"--kernels {chosen}")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        fallback = _stock_fallback(cfg) if chosen in ("stock", "both") else ""
        if args.num_prompts is not None and args.num_prompts < 1:
            raise UserError(f"--num-prompts = {args.num_prompts}: must be >= 1")
        if cfg.model.checkpoint:  # strictly, before vLLM's loader (its errors name no file)
            from titan_rl.checkpoint import check_hf_folder

            check_hf_folder(cfg.model.checkpoint, arch=cfg.model.name)
        env = _episodes_env(cfg, fallback)
    except UserError as e:
        return report_error(e)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    seed = cfg.parity.seed if args.seed is None else args.seed
    n = cfg.parity.num_prompts if args.num_prompts is None else args.num_prompts
    modes = list(KERNEL_MODES) if chosen == "both" else [chosen]
    with tempfile.TemporaryDirectory() as work:
        folder = build_weights(cfg, work)
        vocab = spec_config(cfg, folder).vocab_size
        prompts = make_prompts(cfg, vocab, n, seed)
        results = [run_transformers_pair(cfg, folder, prompts, seed, fallback, with_detail=args.detail)
                   if k == "stock" and fallback else
                   run_engine(cfg, folder, k, prompts, seed, with_detail=args.detail, env=env) for k in modes]
    print_table(results)
    for r in results:
        if "stock_source" in r:
            print(f"stock column: {r['stock_source']}")
    doc = {"config": asdict(cfg), "seed": seed, "num_prompts": n, "results": results,
           **{k: v for k, v in results[0].items()}}
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    from titan_rl.malloc import run_main

    run_main(main)
