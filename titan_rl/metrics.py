"""Sampler-vs-trainer statistics shared by the RL step (titan_rl.rl.trainer) and the
parity harness (titan_rl.parity). Pure functions of local tensors; a distributed caller
combines ranks with the reduction STEP_MISMATCH names for each key."""

from __future__ import annotations

import torch

from titan_rl.kernels.reduction import fixed_sum

# The mismatch keys of an RL step's metrics line and how data-parallel ranks combine them.
STEP_MISMATCH = {"bitwise_fraction": "mean", "max_abs_dlogp": "max", "mean_abs_dlogp": "mean", "k3_mean": "mean"}


def logprob_mismatch(pi: torch.Tensor, mu: torch.Tensor) -> dict[str, float | int]:
    """Trainer (pi) vs sampler (mu) log-probs of the same tokens (matching shapes, at least
    one element), compared in float64: the token count, the fraction bitwise equal,
    max and mean |pi - mu|, and the k3 estimator of KL(mu || pi) (mean and max)."""
    d = pi.double() - mu.double()
    k3 = torch.exp(d) - d - 1  # rho - log(rho) - 1 with rho = pi/mu
    return {
        "tokens": int(d.numel()),
        "bitwise_fraction": _mean(d == 0),
        "max_abs_dlogp": float(d.abs().max()),
        "mean_abs_dlogp": _mean(d.abs()),
        "k3_mean": _mean(k3),
        "k3_max": float(k3.max()),
    }


def _mean(x: torch.Tensor) -> float:
    """The mean in float64, summed in a fixed order (the same at any thread count)."""
    return float(fixed_sum(x.double()) / x.numel())


def full_vocab_mismatch(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float | int]:
    """(trainer, sampler) full log-prob rows [positions, V] per request (at least one
    pair): the positions compared, max |difference| and the fraction of entries bitwise equal."""
    dd = torch.cat([(a.double() - b.double()).abs().flatten() for a, b in pairs])
    return {
        "full_vocab_positions": sum(a.shape[0] for a, _ in pairs),
        "full_vocab_max_abs_dlogp": float(dd.max()),
        "full_vocab_bitwise_fraction": _mean(dd == 0),
    }


def expert_disagreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Routes [N, layers, k] from two sides -> the fraction of (position, layer, slot)
    choices of `a` that are not among `b`'s k experts there (order-free)."""
    if a.shape != b.shape:
        raise ValueError(f"route shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    hit = (a.long()[..., :, None] == b.long()[..., None, :]).any(-1)
    return 1.0 - _mean(hit)


def canonical_sets(ind: torch.Tensor) -> torch.Tensor:
    """Selected positions [..., topk] (-1 = none, in any order) -> each set ascending with the
    -1 entries last: equal sets, equal rows."""
    big = torch.iinfo(torch.int64).max
    v = ind.long()
    s = torch.where(v >= 0, v, big).sort(-1).values
    return torch.where(s == big, -1, s)


def index_disagreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Selected key positions [N, layers, topk] from two sides -> the fraction of (position,
    layer) sets that differ (as sets: order and padding aside)."""
    if a.shape != b.shape:
        raise ValueError(f"index record shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    same = (canonical_sets(a) == canonical_sets(b)).all(-1)
    return 1.0 - _mean(same)
