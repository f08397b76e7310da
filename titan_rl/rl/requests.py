"""The requests an engine link is sent: vLLM prompts and SamplingParams, one per completion.

A step's requests are a pure function of (training.seed, step, global index): this
data-parallel rank's share of the step's prompts, `group_size` completions each, seeded per
completion (titan_rl.rl.seeds). An evaluation's are greedy and unseeded.
"""

from __future__ import annotations

from titan_rl.rl.global_batch import rank_share
from titan_rl.rl.seeds import completion_seeds, prompt_seed


def stop_ids(tokenizer) -> list[int]:
    """Where a completion ends: a chat model's end of turn as well as EOS."""
    return list(getattr(tokenizer, "stop_ids", [tokenizer.eos_id]))


def step_requests(cfg, task, ranks, step: int) -> tuple[list, list[dict], list]:
    """This data-parallel rank's share of `step`'s prompts: (the task examples, the requests,
    their sampling params, seeded from (seed, step, global index))."""
    from vllm import SamplingParams

    a, s, seed = cfg.algorithm, cfg.sampling, cfg.training.seed
    share = rank_share(a.prompts_per_step, ranks.dp_degree, ranks.dp_rank)
    examples = task.sample(a.prompts_per_step, seed=prompt_seed(seed, step))[share.start:share.stop]
    seeds = iter(completion_seeds(seed, step, share, a.group_size))
    stop = stop_ids(task.tokenizer)
    reqs, params = [], []
    for ex in examples:
        for _ in range(a.group_size):
            reqs.append({"prompt_token_ids": list(ex.prompt_ids)})
            params.append(SamplingParams(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=task.max_new_tokens,
                stop_token_ids=stop, logprobs=0, seed=next(seeds)))
    return examples, reqs, params


def greedy_requests(task, examples: list, max_new_tokens: int) -> tuple[list[dict], list]:
    """One greedy request per example, stopping on the task tokenizer's stop ids."""
    from vllm import SamplingParams

    # logprobs=0: the sampled token's own, which the rollout record reads
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stop_ids(task.tokenizer),
                            logprobs=0)
    return [{"prompt_token_ids": list(ex.prompt_ids)} for ex in examples], [params] * len(examples)
