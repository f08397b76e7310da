"""GRPO-style group advantages and the (clipped) importance-sampled policy-gradient loss.

The importance ratio is ``exp(logp - mu)`` where ``mu`` is the log-prob the *sampler*
recorded for each sampled token and ``logp`` is the trainer's log-prob of the same token
under the current weights. Because trainer and sampler compute bitwise-identical
log-probs, ``mu`` must be the sampler's recorded value, never a trainer recomputation:
on-policy, ``logp == mu`` exactly and the ratio is exactly 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_rl.kernels.reduction import fixed_sum

_SCALES = ("std", "none")
_AGGS = ("token_mean", "seq_mean")


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "std", eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages.

    ``rewards`` is 1-D with ``N`` entries, ``N % group_size == 0``; consecutive runs of
    ``group_size`` entries form a group (the completions of one prompt). The advantage
    is ``reward - group mean``, divided by ``group std + eps`` when ``scale == "std"``
    and left unscaled when ``scale == "none"``. Integer rewards are promoted to float32.
    """
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if n % group_size != 0:
        raise ValueError(f"N={n} rewards is not divisible by group_size={group_size}")

    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    groups = rewards.view(n // group_size, group_size)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if scale == "std":
        # Population std (unbiased=False): divide by group_size, not group_size - 1,
        # so a group of one has std 0 (advantage 0) instead of nan.
        adv = adv / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.reshape(n)


@dataclass
class PGLossConfig:
    """Configuration of :func:`policy_gradient_loss`.

    clip_eps: PPO clip range below 1 (ratio clipped to ``[1 - clip_eps, ...]``);
        ``None`` disables clipping (plain importance-sampled policy gradient).
    clip_eps_high: clip range above 1 (``[..., 1 + clip_eps_high]``); ``None`` means the
        same as ``clip_eps``. Ignored when ``clip_eps`` is ``None``.
    agg: ``"token_mean"``: sum over all valid tokens / number of valid tokens;
        ``"seq_mean"``: mean over sequences of each sequence's token mean (sequences
        with no valid token are left out of the mean).
    """

    clip_eps: float | None = 0.2
    clip_eps_high: float | None = None
    agg: str = "token_mean"


def _check_inputs(logp, mu, advantages, mask, cfg: PGLossConfig) -> None:
    if logp.ndim != 2:
        raise ValueError(f"logp must be 2-D [B, T], got shape {tuple(logp.shape)}")
    if mu.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, mu and mask must have the same shape, got {tuple(logp.shape)}, "
            f"{tuple(mu.shape)} and {tuple(mask.shape)}"
        )
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"advantages must have shape [B]={tuple(logp.shape[:1])}, got {tuple(advantages.shape)}"
        )
    if cfg.agg not in _AGGS:
        raise ValueError(f"agg must be one of {_AGGS}, got {cfg.agg!r}")
    for name in ("clip_eps", "clip_eps_high"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0 or None, got {value!r}")


def loss_count(mask: torch.Tensor, agg: str) -> int:
    """What :func:`policy_gradient_loss` divides by under `agg`: the valid tokens of `mask`
    [B, T] (``token_mean``) or its sequences with at least one (``seq_mean``)."""
    tokens_per_seq = mask.bool().sum(dim=1)
    return int(tokens_per_seq.sum().item() if agg == "token_mean" else (tokens_per_seq > 0).sum().item())


def policy_gradient_loss(
    logp: torch.Tensor,
    mu: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PGLossConfig,
    weights: torch.Tensor | None = None,
    count: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped importance-sampled policy-gradient loss.

    logp: [B, T] trainer log-probs of the sampled tokens (carries the gradient).
    mu: [B, T] the sampler's recorded log-probs of the same tokens.
    advantages: [B], one per sequence, broadcast over its tokens.
    mask: [B, T] bool or 0/1; True/1 marks a valid (loss-bearing) token.
    weights: optional [B, T] per-token factors (no gradient), e.g. truncated importance
        weights from titan_rl.algorithms.corrections; the objective is multiplied by them.
    count: the aggregate's denominator (valid tokens for ``token_mean``, sequences with a
        valid token for ``seq_mean``: :func:`loss_count`) over the whole global batch when
        this call sees one data-parallel rank's share of it; the ranks' losses (and
        gradients) then sum to the global batch's. ``None``: this call's own count.

    Per valid token: ``ratio = exp(logp - mu)`` and the objective is
    ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)`` (``ratio * A`` without
    clipping); the loss is ``-aggregate(objective)``. Masked positions are replaced by 0
    in both ``logp`` and ``mu`` before subtracting, so padding such as ``mu = -inf``
    can produce neither inf/nan in the loss nor in the gradient (which is 0 there).

    Returns ``(loss, stats)``; stats are python floats: ``clip_fraction`` (fraction of
    valid tokens where the clipped branch is strictly the smaller one, i.e. the token
    has zero gradient), ``ratio_mean``, ``ratio_max``, ``ratio_min``,
    ``log_ratio_abs_max`` (over valid tokens; nan when there are none) and ``tokens``.
    """
    _check_inputs(logp, mu, advantages, mask, cfg)
    valid = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)

    # where() instead of multiplying by the mask: inf * 0 would be nan, and where()
    # sends a zero gradient to the unselected (masked) entries.
    log_ratio = torch.where(valid, logp, zero) - torch.where(valid, mu.to(logp.dtype), zero)
    ratio = torch.exp(log_ratio)  # exactly 1.0 where logp == mu (and at masked positions)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1], broadcast over tokens

    unclipped = ratio * adv
    if cfg.clip_eps is None:
        objective = unclipped
        clipped_active = torch.zeros_like(valid)
    else:
        eps_low = cfg.clip_eps
        eps_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
        clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
        objective = torch.minimum(unclipped, clipped)
        clipped_active = clipped < unclipped

    if weights is not None:
        objective = objective * weights.detach().to(objective.dtype)
    objective = torch.where(valid, objective, zero)
    tokens_per_seq = valid.sum(dim=1)
    n_tokens = int(tokens_per_seq.sum().item())
    denominator = max(loss_count(valid, cfg.agg) if count is None else count, 1)
    # fixed-order sums (kernels.fixed_sum): the loss is the same number at any thread count
    if cfg.agg == "token_mean":
        aggregated = fixed_sum(objective) / denominator
    else:  # "seq_mean"
        seq_means = fixed_sum(objective, 1) / tokens_per_seq.clamp(min=1)
        aggregated = fixed_sum(seq_means) / denominator
    loss = -aggregated

    with torch.no_grad():
        if n_tokens > 0:
            r = ratio[valid].float()
            stats = {
                "clip_fraction": (clipped_active & valid).sum().item() / n_tokens,
                "ratio_mean": (fixed_sum(r) / r.numel()).item(),
                "ratio_max": r.max().item(),
                "ratio_min": r.min().item(),
                "log_ratio_abs_max": log_ratio[valid].abs().max().item(),
            }
        else:
            nan = float("nan")
            stats = {
                "clip_fraction": 0.0,
                "ratio_mean": nan,
                "ratio_max": nan,
                "ratio_min": nan,
                "log_ratio_abs_max": nan,
            }
        stats["tokens"] = float(n_tokens)
    return loss, stats
