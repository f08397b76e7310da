"""The global batch: a step's prompts (`algorithm.prompts_per_step`) and supervised pairs
(`algorithm.sft_batch`), and the held-out questions of an evaluation (`eval.n`), count the
whole step, over every rank, and are drawn from seeds of
(seed, step) alone (titan_rl.rl.seeds). Data-parallel rank r of D takes the r-th of D
equal, contiguous shares; the TP ranks of one data-parallel group take the same share
(their collectives are one computation). The shares of ranks 0..D-1, concatenated, are
the batch a world of one draws, so the rollouts do not depend on the layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_rl.errors import ConfigError
from titan_rl import layout

if TYPE_CHECKING:
    from titan_rl.config import Config


def data_parallel_degree(world: int, tensor_parallel_degree: int) -> int:
    """The number of data-parallel groups of a `world`-rank run (pipeline and context
    parallel are refused keys, so every other rank dimension is TP)."""
    return max(world // tensor_parallel_degree, 1)


def rank_share(total: int, dp_degree: int, dp_rank: int) -> range:
    """The global indices data-parallel rank `dp_rank` of `dp_degree` takes of `total` items."""
    if total % dp_degree:
        raise ValueError(f"{total} items do not split into {dp_degree} equal data-parallel shares")
    n = total // dp_degree
    return range(dp_rank * n, (dp_rank + 1) * n)


def check_global_batch(cfg: Config, world: int) -> None:
    """Refuse a global batch that the run's data-parallel ranks cannot share equally."""
    tp = cfg.parallelism.tensor_parallel_degree
    dp = data_parallel_degree(world, tp)
    a = cfg.algorithm
    keys = [("algorithm.prompts_per_step", a.prompts_per_step)] + (
        [("algorithm.sft_batch", a.sft_batch)] if a.sft_steps > 0 else []) + (
        [("eval.n", cfg.eval.n)] if cfg.eval.interval > 0 else [])
    for key, n in keys:
        if n % dp:
            raise ConfigError(
                f"{key} = {n} must be divisible by the data-parallel degree {dp} (WORLD_SIZE = {world} / "
                f"parallelism.tensor_parallel_degree = {tp}): it counts the whole step, and each data-parallel "
                f"rank takes an equal share")
    ep = cfg.parallelism.expert_parallel_degree
    if ep > 1 and ep != dp:
        raise ConfigError(f"parallelism.expert_parallel_degree = {ep} must equal the data-parallel degree {dp} "
                          f"(WORLD_SIZE = {world} / parallelism.tensor_parallel_degree = {tp}): every data-parallel "
                          "rank owns an equal share of the experts")
    layout.check_layout(cfg, dp, world)
