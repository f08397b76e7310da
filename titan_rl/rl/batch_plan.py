"""The batch plan: how one step's global batch is cut into pieces, run and reduced.

Two plans implement one interface:

  * `Collective`: each data-parallel rank runs its share as one piece and FSDP2's own
    reduce-scatter sums the ranks' gradients; statistics are the ranks' means. Bits
    depend on the layout.
  * `LeafTree` (parallelism.deterministic_reduction, exact mode's default): the global batch
    is cut into G equal gradient leaves (a power of two, a function of the config alone),
    each rank runs its G/D consecutive leaves, padded to the global batch's width, and
    titan_rl.titan.leaf_reduction adds the leaves' gradients in one fixed tree over leaves
    and ranks; statistics are computed on the gathered global batch. Every layout then
    gives the same bits (docs/torchtitan.md, "Layout invariance").

The rules of the switch are layout rules: titan_rl.layout's `uses_leaf_tree`, `leaf_count`
(auto: at most AUTO_MAX_LEAVES), `check_leaves` (when the config is read) and `check_layout`
(when the world size is known).
"""

from __future__ import annotations

import abc

import torch

from titan_rl.algorithms import apply_corrections
from titan_rl.kernels import tree_sum
from titan_rl.kernels.reduction import fixed_sum
from titan_rl.layout import leaf_count, uses_leaf_tree
from titan_rl.metrics import STEP_MISMATCH, logprob_mismatch
from titan_rl.rl.ranks import Ranks

def gradient_leaves(total: int, n_leaves: int, dp_degree: int, dp_rank: int) -> list[range]:
    """The gradient leaves data-parallel rank `dp_rank` of `dp_degree` owns, as global
    indices of the `total` items: the global batch is cut into `n_leaves` equal, contiguous
    leaves and the rank takes n_leaves / dp_degree consecutive ones, a whole aligned subtree
    of the fixed reduction tree."""
    if n_leaves < 1 or n_leaves & (n_leaves - 1):
        raise ValueError(f"{n_leaves} gradient leaves: must be a power of two")
    if total % n_leaves or n_leaves % dp_degree:
        raise ValueError(f"{total} items do not cut into {n_leaves} equal gradient leaves shared by "
                         f"{dp_degree} data-parallel ranks")
    size, per_rank = total // n_leaves, n_leaves // dp_degree
    first = dp_rank * per_rank
    return [range(j * size, (j + 1) * size) for j in range(first, first + per_rank)]


def plan_for(cfg, model: torch.nn.Module, ranks: Ranks) -> "BatchPlan":
    if uses_leaf_tree(cfg):
        return LeafTree(ranks, model, leaf_count(cfg))
    return Collective(ranks)


# -- the plans -------------------------------------------------------------------------------

class BatchPlan(abc.ABC):
    """The interface: `pieces` cuts a rank's share, `backward` runs one piece's, the rest
    reduce the step's values and statistics over the pieces and ranks."""

    reduction: str  # the contract's gradient_leaves entry

    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    @abc.abstractmethod
    def pieces(self, total: int, start: int) -> tuple[list[range], int]:
        """The pieces of this rank's share (items [start, start + share) of `total`), as local
        rows, each one forward and backward; and how many pieces the whole step has."""

    def widen(self, batch: torch.Tensor, pad: int) -> torch.Tensor:
        """The rank's batch [B, L] as the pieces run it."""
        return batch

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """One piece's backward; `last`: this rank's last piece of the update."""
        loss.backward()

    @abc.abstractmethod
    def step_sum(self, values: list[torch.Tensor]) -> float:
        """The pieces' values summed over the step (the loss)."""

    @abc.abstractmethod
    def piece_mean(self, values: list[torch.Tensor]) -> float:
        """The mean of a per-piece statistic over the step (the MoE auxiliary loss)."""

    @abc.abstractmethod
    def mismatch(self, pi: torch.Tensor, mu: torch.Tensor) -> dict:
        """titan_rl.metrics.logprob_mismatch's step statistics of the step's tokens."""

    @abc.abstractmethod
    def disagreement(self, measure, engine: torch.Tensor, own: torch.Tensor) -> float:
        """measure(engine, own) over the step's recorded choices of one kind (titan_rl.metrics'
        expert_disagreement: routes, index_disagreement: key sets)."""

    @abc.abstractmethod
    def correct(self, pi_old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, corrections
                ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """titan_rl.algorithms.apply_corrections for this rank's rows: (weights, mask, stats)."""

    @abc.abstractmethod
    def batch_stats(self, rewards: torch.Tensor, tokens: int, rows: int, loss_mask: torch.Tensor,
                    pieces: list[tuple[float, int]]) -> dict:
        """reward_mean, response_length and clip_fraction of the step; `pieces`: the last
        update's (clip_fraction, valid tokens) per piece."""


class Collective(BatchPlan):
    reduction = "collective"

    def pieces(self, total, start):
        return [range(0, total // self.ranks.dp_degree)], self.ranks.dp_degree

    def step_sum(self, values):
        return self.ranks.reduce(float(sum(values)), "sum", over_dp=True)

    def piece_mean(self, values):
        return self.ranks.reduce(float(values[-1]), "mean")

    def mismatch(self, pi, mu):
        m = logprob_mismatch(pi, mu)
        return {k: self.ranks.reduce(m[k], how) for k, how in STEP_MISMATCH.items()}

    def disagreement(self, measure, engine, own):
        return self.ranks.reduce(measure(engine, own), "mean")

    def correct(self, pi_old, mu, mask, corrections):
        weights, new_mask, stats = apply_corrections(pi_old, mu, mask, corrections)
        return weights, new_mask, {k: self.ranks.reduce(v, "mean") for k, v in stats.items()}

    def batch_stats(self, rewards, tokens, rows, loss_mask, pieces):
        r = self.ranks
        return {"reward_mean": r.reduce(float(rewards.mean()), "mean"),
                "response_length": r.reduce(tokens / rows, "mean"),
                "clip_fraction": r.reduce(pieces[-1][0], "mean")}


class LeafTree(BatchPlan):
    def __init__(self, ranks: Ranks, model: torch.nn.Module, n_leaves: int):
        from titan_rl.titan.expert_parallel import expert_parallel_of
        from titan_rl.titan import leaf_reduction

        super().__init__(ranks)
        self.n_leaves = n_leaves
        self.reduction = f"{n_leaves} leaves, fixed tree"
        self.switch = leaf_reduction.install(model)
        self.experts = expert_parallel_of(model)  # the expert-parallel experts' own trees

    def pieces(self, total, start):
        r = self.ranks
        own = gradient_leaves(total, self.n_leaves, r.dp_degree, r.dp_rank)
        return [range(leaf.start - start, leaf.stop - start) for leaf in own], self.n_leaves

    def widen(self, batch, pad):
        """Right-padded to the global batch's longest row, so every leaf has the same shape on
        every layout (a row's forward does not depend on padding after it)."""
        width = int(self.ranks.reduce(float(batch.shape[1]), "max", over_dp=True))
        return torch.nn.functional.pad(batch, (0, width - batch.shape[1]), value=pad)

    def backward(self, loss, last):
        self.switch.last_leaf = last
        loss.backward()
        if self.experts is not None:
            self.experts.leaf_done(last)

    def step_sum(self, values):
        return float(tree_sum(self.ranks.gather_dp(torch.stack(values), same_shape=True)))

    def piece_mean(self, values):
        return self.step_sum(values) / self.n_leaves

    def mismatch(self, pi, mu):
        # one exchange for the two (float64 holds both exactly; the statistics compare in it)
        both = self.ranks.gather_dp(torch.stack([pi.double(), mu.double()], 1))
        m = logprob_mismatch(both[:, 0], both[:, 1])
        return {k: m[k] for k in STEP_MISMATCH}

    def disagreement(self, measure, engine, own):
        return measure(self.ranks.gather_dp(engine), self.ranks.gather_dp(own))

    def correct(self, pi_old, mu, mask, corrections):
        """On the global batch (the same masks and fractions on every layout); this rank keeps its rows."""
        def g(t):  # every rank's rows: [B, L] (widened), the same shape on every rank
            return self.ranks.gather_dp(t, same_shape=True)

        rows = slice(self.ranks.dp_rank * pi_old.shape[0], (self.ranks.dp_rank + 1) * pi_old.shape[0])
        weights, new_mask, stats = apply_corrections(g(pi_old), g(mu), g(mask), corrections)
        return weights[rows], new_mask[rows], stats

    def batch_stats(self, rewards, tokens, rows, loss_mask, pieces):
        r = self.ranks
        clipped = sum(round(fraction * n) if n else 0 for fraction, n in pieces)
        # counts (integers: exact in float64 whatever the order of the sum), in one exchange
        valid, tokens, clipped = r.reduce_sums([float(loss_mask.sum()), tokens, clipped], over_dp=True)
        every = r.gather_dp(rewards, same_shape=True)  # B rows per rank
        return {"reward_mean": float(fixed_sum(every) / every.numel()),
                "response_length": tokens / (rows * r.dp_degree),
                "clip_fraction": clipped / max(valid, 1.0)}
