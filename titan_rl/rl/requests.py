"""The episodes an engine link is sent (titan_rl.rl.episodes), and their SamplingParams.

A step's episodes are a pure function of (training.seed, step, global index): this
data-parallel rank's share of the step's starts (a task's examples, an environment's
seeds), `group_size` episodes each, each seeded by its global index (titan_rl.rl.seeds;
turn t > 0 reseeds from it). An evaluation's are greedy and unseeded.
"""

from __future__ import annotations

from titan_rl.rl.episodes import EpisodeRequest
from titan_rl.rl.global_batch import rank_share
from titan_rl.rl.seeds import completion_seeds, prompt_seed


def stop_ids(tokenizer) -> list[int]:
    """Where a reply ends: a chat model's end of turn as well as EOS."""
    return list(getattr(tokenizer, "stop_ids", [tokenizer.eos_id]))


def step_episodes(cfg, env, ranks, step: int) -> list[EpisodeRequest]:
    """This data-parallel rank's share of `step`'s episodes, `group_size` per start, seeded
    from (seed, step, global index)."""
    from vllm import SamplingParams

    a, s, seed = cfg.algorithm, cfg.sampling, cfg.training.seed
    share = rank_share(a.prompts_per_step, ranks.dp_degree, ranks.dp_rank)
    starts = env.starts(a.prompts_per_step, seed=prompt_seed(seed, step))[share.start:share.stop]
    seeds = iter(completion_seeds(seed, step, share, a.group_size))
    stop = stop_ids(env.tokenizer)
    out = []
    for i, start in enumerate(starts):
        for g in range(a.group_size):
            params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                    max_tokens=env.max_new_tokens, stop_token_ids=stop, logprobs=0, seed=next(seeds))
            out.append(EpisodeRequest((share.start + i) * a.group_size + g, start, params))
    return out


def greedy_episodes(env, starts: list, max_new_tokens: int, first_index: int = 0) -> list[EpisodeRequest]:
    """One greedy episode per start, replies stopping on the tokenizer's stop ids."""
    from vllm import SamplingParams

    # logprobs=0: the sampled token's own, which the rollout record reads
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stop_ids(env.tokenizer),
                            logprobs=0)
    return [EpisodeRequest(first_index + i, start, params) for i, start in enumerate(starts)]


def prompt_episodes(prompts: list[list[int]], params: list) -> list[EpisodeRequest]:
    """Bare prompts as one-reply episodes with no environment (tests, benchmarks)."""
    return [EpisodeRequest(i, list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
