"""Tensor-parallel linears whose GEMM calls have FIXED shapes: the same bits for any TP degree.

The single-process pieces live in the kernels (titan_rl.kernels: `linear_n_blocks`,
`linear_k_leaves`, `leaf_partials`, `tree_sum`; the why is in
kernels/matmul/torch_impl.py) and the model file uses them when its config has
`tp_leaves = L > 0` (q/k/v/gate/up as L column blocks, o/down as L K-leaves), so the
trainer at TP = 1 and the rollout engine already compute these pieces. This module adds
the sharded forms for TP = t (t dividing L):

  * column-parallel (weight_local = this rank's N/t output rows): L/t whole column
    blocks, the same `linear` calls as those columns of `linear_n_blocks(x, w, L)`;
    backward, the rank's blocks' input-gradient partials are one subtree of the blocks'
    fixed tree, which the ranks finish together (`gather_tree_sum`);
  * row-parallel (x_local, weight_local = this rank's K/t share): the rank's L/t leaves
    = one whole subtree, summed locally; the ranks all_gather their subtree sums and
    every rank finishes the SAME fixed tree: equal to `linear_k_leaves(x, w, L)`.

Each leaf is computed by the same call on the same values on every layout, and each
tree node is the same fp32 addition, so TP = 1, 2, 4, ..., L give identical bits.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from titan_rl.kernels import leaf_partials, linear, linear_k_leaves, linear_n_blocks, tree_sum

__all__ = [
    "K_LEAVES", "column_parallel_linear", "copy_to_tp", "gather_rows", "gather_tree_sum", "leaf_partials",
    "linear_k_leaves", "linear_n_blocks", "row_parallel_linear", "tree_sum",
]

K_LEAVES = 8  # a good default leaf count: serves TP = 1, 2, 4, 8


def gather_tree_sum(local: torch.Tensor, group) -> torch.Tensor:
    """The ranks' subtree sums (rank r: the r-th of t equal, aligned subtrees) all_gathered
    in rank order and the same fixed tree finished on every rank (no autograd)."""
    local = local.contiguous()
    bufs = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(bufs, local, group=group)
    return tree_sum(torch.stack(bufs))


def gather_rows(local: torch.Tensor, group) -> torch.Tensor:
    """The ranks' rows (dim 0) all_gathered and concatenated in rank order (no autograd)."""
    local = local.contiguous()
    bufs = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(bufs, local, group=group)
    return torch.cat(bufs)


class _GatherTreeSum(torch.autograd.Function):
    """Forward: all_gather the ranks' subtree sums and finish the fixed tree.
    Backward: y = sum of the subtrees, so each rank's subtree gets grad_y (identical on
    all TP ranks, which compute the same replicated activations after this point)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        return gather_tree_sum(local, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceSum(torch.autograd.Function):
    """Plain row-parallel reduction (not TP-invariant): forward all_reduce(SUM), backward identity."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        out = local.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToTP(torch.autograd.Function):
    """Input of a column-parallel linear: forward identity, backward all_reduce(SUM) of
    the ranks' partial input gradients (Megatron's `f`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def column_parallel_linear(x: torch.Tensor, weight_local: torch.Tensor, group,
                           n_blocks: int = K_LEAVES) -> torch.Tensor:
    """Column-parallel linear: weight_local [N/t, K] holds this rank's consecutive output
    columns. n_blocks > 0: n_blocks/t fixed blocks (bitwise equal to the same columns of
    `linear_n_blocks` on the full weight), and the input gradient the same fixed tree
    over all n_blocks blocks' partials as `linear_n_blocks` computes in one process;
    0: one call (exact only where the kernel's bits do not depend on N) whose input
    gradient is all-reduced (`copy_to_tp`)."""
    t = dist.get_world_size(group)
    if n_blocks == 0:
        return linear(copy_to_tp(x, group), weight_local)
    if n_blocks % t:
        raise ValueError(f"n_blocks = {n_blocks} must be a multiple of the TP degree {t}")
    return linear_n_blocks(x, weight_local, n_blocks // t, finish=partial(gather_tree_sum, group=group))


def row_parallel_linear(x_local: torch.Tensor, weight_local: torch.Tensor, group,
                        k_leaves: int = K_LEAVES) -> torch.Tensor:
    """Row-parallel linear: x_local [..., K/t] and weight_local [N, K/t] hold this rank's
    consecutive K-share (rank r: [r*K/t, (r+1)*K/t)). k_leaves > 0: the TP-invariant
    leaf tree (bitwise equal to `linear_k_leaves` on the full K). k_leaves = 0: one local
    GEMM per rank + all_reduce (close to, not bitwise equal to, the unsharded GEMM)."""
    t = dist.get_world_size(group)
    if k_leaves == 0:
        return _AllReduceSum.apply(linear(x_local, weight_local), group)
    if k_leaves % t:
        raise ValueError(f"k_leaves = {k_leaves} must be a multiple of the TP degree {t}")
    local = tree_sum(leaf_partials(x_local, weight_local, k_leaves // t))
    return _GatherTreeSum.apply(local, group).to(x_local.dtype)
