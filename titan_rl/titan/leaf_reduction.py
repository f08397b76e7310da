"""Layout-invariant gradient reduction under FSDP2: the same gradient bits for any FSDP degree.

Why: FSDP2's reduce-scatter adds the ranks' gradients in the collective's own order, and a
rank's gradient is itself a sum over the tokens of its share (a GEMM whose blocking follows
its shape), so FSDP = 1 and FSDP = 2 round differently after one step. What fixes the bits:

  * gradient leaves: the global batch is cut into G equal leaves (G a power of two, the same
    for every layout; titan_rl.rl.global_batch.gradient_leaves) and each data-parallel rank
    owns G/D consecutive leaves, a whole aligned subtree. Each leaf is one forward and one
    backward on a batch of fixed shape, so every backward GEMM has the same shape and
    values on every layout;
  * a fixed tree: each FSDP unit's flat gradient of each leaf is pushed onto a binary-counter
    stack (`TreeStack`: equal levels merge, so 2^k leaves give tree_sum's balanced tree);
    after the rank's last leaf, the ranks exchange their subtree sums shard by shard (one
    all_to_all: rank j receives every rank's j-th shard, in rank order) and each rank finishes
    the same tree over ranks on its own shard. FSDP = 1, 2, 4, ... then add the same leaves in
    the same order: ((l0 + l1) + (l2 + l3)) + ...

TorchTitan's FSDP2 stays the engine: `install` gives every FSDP unit a custom reduce-scatter
(FSDPModule.set_custom_reduce_scatter) when the FSDP group has more than one rank, and an
all-reduce hook (FSDP2 skips the collective for one rank and calls the hook on its copy)
otherwise. Before the last leaf the units return zeros, which FSDP accumulates into the
sharded gradients (0 + x == x), so the gradients FSDP holds after the last leaf's backward
are the tree's. The clipping norm and AdamW then see the same values on shards and on the
whole (elementwise optimizer updates; the norm over full gradients, rl/trainer.py).

Cost (scripts/bench_layout.py): G/D forwards/backwards of the leaves per rank instead of one,
and the stack's nodes (log2(G/D) + 1 flat gradients of a unit). The exchange moves what a
reduce-scatter moves (each rank sends (D - 1)/D of its flat gradient and receives as much);
on gloo, two ranks, the debug model's units, it took half of gloo's own reduce_scatter's time
(docs/torchtitan.md, "Cost").
Not covered: HSDP (dp_replicate > 1). Under TP (tp_leaves > 0) the TP ranks' partial sums go
through the model file's own fixed trees (titan_rl/parallel/tp_linear.py), so FSDP x TP layouts agree too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

from titan_rl.kernels.reduction import fixed_sum

__all__ = ["LeafReduction", "TreeStack", "grad_norm", "install", "ranks_tree"]


class TreeStack:
    """Adds the tensors pushed one by one in a fixed balanced binary tree: a node of level k
    holds the sum of 2^k consecutive leaves; pushing merges equal levels (a binary counter).
    With 2^k pushes, `pop()` equals `tree_sum` of the stacked leaves, bit for bit."""

    def __init__(self) -> None:
        self._nodes: list[tuple[int, torch.Tensor]] = []

    def push(self, t: torch.Tensor) -> None:
        level = 0
        while self._nodes and self._nodes[-1][0] == level:
            t = self._nodes.pop()[1] + t
            level += 1
        self._nodes.append((level, t))

    def pop(self) -> torch.Tensor:
        if len(self._nodes) != 1:
            levels = [lv for lv, _ in self._nodes]
            raise RuntimeError(f"leaf count is not a power of two (tree levels {levels})")
        return self._nodes.pop()[1]


class LeafReduction:
    """The switch the training step sets: `last_leaf` True before the backward of this rank's
    last leaf of a step (every rank owns the same number of leaves, so all reach it together)."""

    def __init__(self) -> None:
        self.last_leaf = True
        self.units = 0


class _UnitTree:
    def __init__(self, reduction: LeafReduction) -> None:
        self.reduction, self.stack = reduction, TreeStack()

    def reduce(self, flat: torch.Tensor, out: torch.Tensor, group) -> None:
        """flat: this rank's reduce-scatter input of one leaf ([world, shard] rank-major);
        out: this rank's shard. Zeros until the last leaf, then the tree over leaves and ranks."""
        # FSDP2 allocates a fresh reduce-scatter input per call and never writes it again, so
        # the stack may hold it as is; at FSDP = 1 (the all-reduce hook) flat IS out, which
        # FSDP keeps as the gradient and we zero below: that one must be copied.
        self.stack.push(flat.clone() if flat is out else flat)
        if not self.reduction.last_leaf:
            out.zero_()
            return
        mine = self.stack.pop()
        if group is None:
            if mine is not out:
                out.copy_(mine)
            return
        ranks_tree(mine, out, group)


def ranks_tree(mine: torch.Tensor, out: torch.Tensor, group) -> None:
    """out = this rank's shard of tree_sum over the ranks' `mine` ([world, shard] rank-major),
    bit for bit, moving only shards: one all_to_all gives this rank every rank's shard of
    it in rank order, then the same balanced tree (neighbours first) runs on the shard
    alone, its last level written into `out`. The all_gather of whole gradients this
    replaces moved D times as much and added D shards that D - 1 ranks threw away."""
    world = dist.get_world_size(group)
    parts = torch.empty_like(mine)
    dist.all_to_all_single(parts, mine, group=group)
    parts = parts.view(world, -1)
    while parts.shape[0] > 2:
        parts = parts[0::2] + parts[1::2]
    torch.add(parts[0], parts[1], out=out.view(-1))


class _TreeReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter for a unit of an FSDP group of more than one rank."""

    def __init__(self, tree: _UnitTree) -> None:
        self.tree = tree

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.tree.reduce(input_tensor, output_tensor, group)
        return None


def install(model: nn.Module) -> LeafReduction:
    """Give every FSDP unit of `model` the leaf-tree reduction; returns the switch. Every
    parameter of a unit takes part in every leaf (unused ones with zeros), so a unit's flat
    buffer has the same layout in every leaf."""
    reduction = LeafReduction()
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        groups = m._get_fsdp_state()._fsdp_param_groups
        if not groups:
            continue
        if len(groups) > 1:
            raise ValueError("deterministic reduction needs one FSDP parameter group per unit")
        info = groups[0].mesh_info
        if isinstance(info, DDPMeshInfo):
            raise ValueError("deterministic reduction does not cover HSDP (parallelism.data_parallel_replicate_degree "
                             "> 1); use data_parallel_shard_degree alone")
        tree = _UnitTree(reduction)
        m.set_reduce_scatter_unused_params(True)
        if info.shard_mesh_size > 1:
            m.set_custom_reduce_scatter(_TreeReduceScatter(tree))
        else:
            m.set_all_reduce_hook(lambda out, _tree=tree: _tree.reduce(out, out, None))
        reduction.units += 1
    if not reduction.units:
        raise ValueError("deterministic reduction: the model has no FSDP unit (apply FSDP first)")
    return reduction


def grad_norm(params) -> torch.Tensor:
    """The global L2 norm of the parameters' gradients, the same bits on every layout and at
    every thread count: each gradient is taken whole (full_tensor() of a sharded one: the
    same tensor whatever the FSDP or TP degree), squared in fp32 and summed in a fixed order
    (kernels.fixed_sum), and the per-parameter sums are added in parameter order."""
    total = torch.zeros((), dtype=torch.float32)
    for p in params:
        if p.grad is not None:
            g = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
            total = total + fixed_sum(g * g)
    return torch.sqrt(total)
