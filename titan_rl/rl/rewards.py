"""A rollout's rewards: each episode's, as its environment scored it, each checked; and the
engine's log-probs, checked finite before anything trains on them."""

from __future__ import annotations

import torch

from titan_rl.errors import RunStopped, UserError
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


def check_logprobs(rollout, ranks, step: int) -> None:
    """Every sampled token's mu is a finite number: vLLM has been seen to return NaN log-probs
    (TorchTitan #3602), and one would turn the ratio, the loss and the weights NaN. All ranks
    stop together, before the step trains; the run's last checkpoint is untouched."""
    bad = None
    for i, mu in enumerate(rollout.mu):
        sampled = rollout.sampled[i] if rollout.sampled is not None else torch.ones(len(mu), dtype=torch.bool)
        wrong = (~torch.isfinite(mu) & sampled).nonzero()
        if len(wrong):
            k = int(wrong[0])
            ep = f" (episode {rollout.episodes[i].index})" if rollout.episodes is not None else ""
            bad = (f"step {step}: the engine's log-prob of token {rollout.tokens[i][k]} (position {k} after the prompt) "
                   f"of request {rollout.request_ids[i]!r}{ep} is {float(mu[k])}: the step stops before training on it "
                   f"({int(wrong.numel())} such tokens in that request); the last checkpoint is untouched")
            break
    if ranks.any(bad is not None):
        raise RunStopped(bad or f"step {step}: another rank's engine returned a non-finite log-prob (it names the "
                                "request)")
