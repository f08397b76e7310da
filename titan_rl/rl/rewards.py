"""A rollout's rewards: the task's reward of each request's sampled tokens, each checked."""

from __future__ import annotations

import torch

from titan_rl.errors import UserError
from titan_rl.tasks import check_reward


def step_rewards(cfg, task, ranks, step: int, examples: list, tokens: list[list[int]]) -> torch.Tensor:
    """float32 [len(tokens)], each checked finite (a NaN reward would make the advantages,
    the loss and then the weights NaN); all ranks stop together when one rank's task
    returned one."""
    g, out, error = cfg.algorithm.group_size, [], None
    for j, (ex, toks) in enumerate(zip(examples, tokens)):
        try:
            out.append(check_reward(task.reward(ex, toks), cfg.task.name, j // g, ex, j % g, toks, task.tokenizer,
                                    step))
        except UserError as e:
            error = e
            break
    if ranks.any(error is not None):
        raise error or UserError(f"step {step}: another rank's task returned a non-finite reward")
    return torch.tensor(out, dtype=torch.float32)
