"""Linears whose GEMM calls have FIXED shapes: the same bits for any TP degree.

Column-parallel (q/k/v/gate/up: output columns split over ranks). The batch-invariant
kernel pins the row count of each GEMM call, not N: a rank's call has N/t columns, and
MKL/oneDNN pick blocking and thread splits from N, so a column's bits can change with
the TP degree (measured: fp32 at K >= 1024 with 1 thread, bf16 at most Qwen3 sizes
with 2 threads). `linear_n_blocks` cuts N into `n_blocks` equal column blocks, one call
each; with TP = t a rank holds n_blocks/t whole blocks and issues the same calls.

Row-parallel. A row-parallel linear (o_proj, down_proj) splits the reduction dimension K over
the TP ranks; summing the ranks' partial GEMMs (all-reduce) adds in another order than
one GEMM over the whole K, so TP=2 logits differ from TP=1 in the last bits, and from
the rollout engine's.

The fix (PLATFORM.md, "Tensor parallel"): cut K into `k_leaves` equal leaves, a number
that does NOT depend on the TP degree (8 serves TP = 1, 2, 4, 8). Every leaf's partial
product is one call of the batch-invariant kernel `linear` on a contiguous
[rows, K/k_leaves] x [K/k_leaves, N] problem, upcast to fp32. The leaves are combined
by a balanced pairwise tree: ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). With TP = t each rank
owns k_leaves/t consecutive leaves = one whole subtree; it sums that subtree locally,
the ranks all_gather their subtree sums and every rank finishes the SAME tree. A leaf
is computed by the same call on the same values on every layout, and each tree node
is the same fp32 addition, so TP = 1, 2, 4, 8 give identical bits.

`linear_n_blocks` / `linear_k_leaves` are the single-process (TP = 1) forms. The
rollout engine must call them for the same layers too, or the trainer's TP-invariant
logits differ from the engine's (docs/torchtitan.md: the model file decides).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_rl.kernels import linear

K_LEAVES = 8  # also the default number of column blocks: serves TP = 1, 2, 4, 8


def _check(k: int, k_leaves: int) -> None:
    if k_leaves < 1 or k_leaves & (k_leaves - 1):
        raise ValueError(f"k_leaves = {k_leaves} must be a power of two")
    if k % k_leaves:
        raise ValueError(f"K = {k} is not divisible by k_leaves = {k_leaves}")


def tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """Balanced pairwise sum over dim 0 (length a power of two): level by level,
    neighbours added elementwise. Elementwise adds are exact IEEE operations, so the
    result depends only on the values and the (fixed) tree, never on the layout."""
    n = parts.shape[0]
    if n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two count, got {n}")
    while parts.shape[0] > 1:
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def leaf_partials(x: torch.Tensor, weight: torch.Tensor, n_leaves: int) -> torch.Tensor:
    """fp32 partial products of `n_leaves` equal K-slices: [n_leaves, *x.shape[:-1], N].

    Each leaf is made contiguous before the GEMM, so a leaf's call sees the same
    shapes and strides whether x holds all of K (TP = 1) or one rank's share."""
    k = x.shape[-1]
    _check(k, n_leaves)
    kl = k // n_leaves
    lead, n = x.shape[:-1], weight.shape[0]
    xs = x.reshape(-1, n_leaves, kl).transpose(0, 1).contiguous()  # [L, M, kl]
    ws = weight.reshape(n, n_leaves, kl).transpose(0, 1).contiguous()  # [L, N, kl]
    parts = torch.stack([linear(xs[i], ws[i]).float() for i in range(n_leaves)])
    return parts.reshape(n_leaves, *lead, n)


def linear_n_blocks(x: torch.Tensor, weight: torch.Tensor, n_blocks: int = K_LEAVES) -> torch.Tensor:
    """y = x @ weight^T computed as `n_blocks` calls of the kernel `linear`, one per block
    of weight.shape[0] / n_blocks consecutive output columns. A column's bits then
    depend only on its block, so a TP rank holding blocks [i, j) reproduces them."""
    n = weight.shape[0]
    if n_blocks < 1 or n % n_blocks:
        raise ValueError(f"N = {n} is not divisible by n_blocks = {n_blocks}")
    if n_blocks == 1:
        return linear(x, weight)
    t = n // n_blocks
    return torch.cat([linear(x, weight[j * t:(j + 1) * t]) for j in range(n_blocks)], -1)


def linear_k_leaves(x: torch.Tensor, weight: torch.Tensor, k_leaves: int = K_LEAVES) -> torch.Tensor:
    """y = x @ weight^T with the reduction over K cut into `k_leaves` leaves summed by a
    fixed fp32 tree; output in x's dtype. Equal, bit for bit, to `row_parallel_linear`
    on any TP degree dividing k_leaves."""
    return tree_sum(leaf_partials(x, weight, k_leaves)).to(x.dtype)


class _GatherTreeSum(torch.autograd.Function):
    """Forward: all_gather the ranks' subtree sums and finish the fixed tree.
    Backward: y = sum of the subtrees, so each rank's subtree gets grad_y (identical on
    all TP ranks, which compute the same replicated activations after this point)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        world = dist.get_world_size(group)
        local = local.contiguous()
        bufs = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(bufs, local, group=group)
        return tree_sum(torch.stack(bufs))

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
    `linear_n_blocks` on the full weight); 0: one call (exact only where the kernel's
    bits do not depend on N)."""
    t = dist.get_world_size(group)
    x = copy_to_tp(x, group)
    if n_blocks == 0:
        return linear(x, weight_local)
    if n_blocks % t:
        raise ValueError(f"n_blocks = {n_blocks} must be a multiple of the TP degree {t}")
    return linear_n_blocks(x, weight_local, n_blocks // t)


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
