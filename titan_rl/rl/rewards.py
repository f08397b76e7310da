"""A rollout's rewards: each episode's, as its environment scored it, each checked."""

from __future__ import annotations

import torch

from titan_rl.errors import UserError
from titan_rl.tasks import check_reward


def step_rewards(cfg, env, ranks, step: int, episodes: list, rollout) -> torch.Tensor:
    """float32 [rollout rows]: each row's episode reward (`episodes`: the rank's
    EpisodeRequests, in row order, each owning `rows // len(episodes)` rows), each checked
    finite (a NaN reward would make the advantages, the loss and then the weights NaN); all
    ranks stop together when one rank's environment returned one."""
    g, per, out, error = cfg.algorithm.group_size, len(rollout) // max(len(episodes), 1), [], None
    for j, ep in enumerate(episodes):
        info = rollout.episodes[j * per]
        try:
            r = check_reward(info.reward, cfg.task.name, j // g, ep.start, j % g, rollout.tokens[j * per], env.tokenizer,
                             step)
        except UserError as e:
            error = e
            break
        out += [r] * per
    if ranks.any(error is not None):
        raise error or UserError(f"step {step}: another rank's task returned a non-finite reward")
    return torch.tensor(out, dtype=torch.float32)
