"""Where a training step's time goes, deterministic reduction vs FSDP2's own, per rank.

    torchrun --nproc_per_node=2 scripts/profile_layout.py OUT_PREFIX [titan_rl.train args...]
    python scripts/profile_layout.py --summary OUT_PREFIX [--min]

The first form runs the trainer with scripts/bench_layout.py's alternating steps (odd steps
deterministic, even steps FSDP2's reduce-scatter; pass
--parallelism.deterministic_reduction=true) and wall-clock timers around the step's parts:
the model's forward (without FSDP's hooks), the backward, FSDP2's parameter all-gathers
and gradient reductions, the leaf tree's own parts, the batch plan's statistics
collectives, the clip norm, AdamW. One JSON line per step goes to OUT_PREFIX.rank<R>.jsonl.
The second form prints, per phase, each mode's median (or --min: minimum) per timer over
the steps after the first pair, both ranks' values averaged. The timers nest (e.g. the
reductions run inside the backward), so the rows do not add up.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict

_T: dict[str, float] = defaultdict(float)
_N: dict[str, int] = defaultdict(int)


def _timed(owner, name: str, key: str) -> None:
    fn = getattr(owner, name, None)
    if fn is None:  # a renamed method would leave its phase silently untimed
        raise SystemExit(f"profile_layout: {getattr(owner, '__name__', owner)}.{name} does not exist: the code it "
                         "times was renamed; update _timed's targets in scripts/profile_layout.py")

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _T[key] += time.perf_counter() - t0
            _N[key] += 1

    setattr(owner, name, wrapper)


def install(out_prefix: str) -> None:
    from titan_rl.titan import cpu_compat  # noqa: F401  (before torchtitan)
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    from titan_rl.rl import batch_plan, trainer
    from titan_rl.titan import leaf_reduction
    from titan_rl.titan import model as titan_model

    # FSDP2: copy-in + reduce-scatter (or the leaf tree) + accumulation, per unit
    _timed(pg, "foreach_reduce", "fsdp_reduce")
    _timed(pg, "foreach_all_gather", "fsdp_all_gather")
    _timed(pg, "foreach_all_gather_copy_out", "fsdp_all_gather_copy_out")
    _timed(coll.DefaultReduceScatter, "__call__", "fsdp_reduce_scatter")  # plain steps (ours overrides it)
    _timed(coll, "foreach_reduce_scatter_copy_in", "fsdp_rs_copy_in")
    pg.foreach_reduce_scatter_copy_in = coll.foreach_reduce_scatter_copy_in
    _timed(leaf_reduction._UnitTree, "reduce", "tree_reduce")
    _timed(leaf_reduction, "ranks_tree", "tree_ranks_exchange_add")
    for d in ("all_gather", "all_gather_object", "all_reduce", "all_to_all_single"):
        _timed(dist, d, f"dist.{d}")
    _timed(leaf_reduction, "grad_norm", "grad_norm")
    for plan in (batch_plan.LeafTree, batch_plan.Collective):
        for meth in ("backward", "step_sum", "piece_mean", "mismatch", "correct", "batch_stats", "widen"):
            if meth in plan.__dict__ or meth in batch_plan.BatchPlan.__dict__:
                _timed(plan, meth, f"plan.{meth}")
    _timed(titan_model.TitanModel, "forward", "model_forward")
    T = trainer.RLTrainer
    for meth in ("_score", "_rollout"):
        _timed(T, meth, meth)
    from titan_rl.rl.optimizer_step import OptimizerStep

    _timed(OptimizerStep, "__call__", "_optimizer_step")  # clip, skip or step (was RLTrainer._optimizer_step)
    _timed(torch.optim.AdamW, "step", "adamw")

    step_fn = T.train_step
    rank = int(os.environ.get("RANK", "0"))
    path = f"{out_prefix}.rank{rank}.jsonl"
    open(path, "w").close()

    def train_step(self, data_iterator):
        _T.clear()
        _N.clear()
        t0 = time.perf_counter()
        step_fn(self, data_iterator)
        row = {"step": self.step, "phase": "sft" if self.step <= self.rl.algorithm.sft_steps else "rl",
               "mode": getattr(self, "_bench_mode", None), "total": time.perf_counter() - t0, **dict(_T),
               "calls": dict(_N)}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    T.train_step = train_step


def summary(prefix: str, agg=statistics.median) -> None:
    rows = {r: [json.loads(line) for line in open(f"{prefix}.rank{r}.jsonl")] for r in (0, 1)}
    for phase in ("sft", "rl"):
        table: dict[str, dict[str, float]] = {}
        for mode in ("deterministic", "plain"):
            per_rank = []
            for r in (0, 1):
                steps = [x for x in rows[r] if x["phase"] == phase][2:]
                steps = [x for x in steps if x["mode"] == mode]
                keys = {k for x in steps for k in x if k not in ("step", "phase", "mode", "calls")}
                per_rank.append({k: agg([x.get(k, 0.0) for x in steps]) for k in keys})
            keys = set(per_rank[0]) | set(per_rank[1])
            table[mode] = {k: 1000 * sum(p.get(k, 0.0) for p in per_rank) / 2 for k in keys}
        keys = sorted(set(table["deterministic"]) | set(table["plain"]), key=lambda k: (k != "total", k))
        print(f"== {phase}: ms per step, {agg.__name__} over steps, mean of the 2 ranks")
        print(f"{'':28s}{'deterministic':>15s}{'plain':>10s}{'det - plain':>13s}")
        for k in keys:
            d, p = table["deterministic"].get(k, 0.0), table["plain"].get(k, 0.0)
            print(f"{k:28s}{d:15.1f}{p:10.1f}{d - p:13.1f}")


if __name__ == "__main__":
    if sys.argv[1] == "--summary":
        summary(sys.argv[2], min if "--min" in sys.argv else statistics.median)
        sys.exit(0)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_layout

    bench_layout.install_alternation("deterministic")
    install(sys.argv[1])
    from titan_rl.train import main

    sys.exit(main(sys.argv[2:]))
