"""The fixed-shape tensor-parallel pieces (the why: torch_impl.py's "fixed-shape pieces"),
written once over a form's GEMMs so the torch (CPU) and Triton (GPU) forms compose their own
row-invariant GEMMs the same way: the same K-leaves, column blocks and trees, whatever the
device. A form passes a `Gemms`; the functions below are bound to it in each form's module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Gemms:
    linear: Callable  # (x [..., K], weight [N, K]) -> [..., N] in x's dtype, row-invariant (autograd-aware)
    mm: Callable  # (x2 [M, K], weight [N, K]) -> [M, N] in x2's dtype, no autograd
    grad_input: Callable  # (grad [M, N], weight [N, K]) -> [M, K], one fixed-shape call
    grad_weight: Callable  # (grad [M, N], x2 [M, K]) -> [N, K], one fixed-shape call
    tree_sum: Callable  # parts [2^j, ...] -> their balanced pairwise sum


def padded_tree_sum(parts: torch.Tensor, tree: Callable) -> torch.Tensor:
    """`tree` (a form's tree_sum) over dim 0 of any length: zeros complete it to a power of
    two (x + 0 == x), so n parts are added by the same tree whoever holds them (the sums over
    heads: a per-head RMSNorm's weight gradient, sparse attention's cache gradient)."""
    n = parts.shape[0]
    width = 1 << (n - 1).bit_length()
    if width != n:
        parts = torch.cat([parts, parts.new_zeros(width - n, *parts.shape[1:])])
    return tree(parts)


def check_leaves(k: int, k_leaves: int) -> None:
    if k_leaves < 1 or k_leaves & (k_leaves - 1):
        raise ValueError(f"k_leaves = {k_leaves} must be a power of two")
    if k % k_leaves:
        raise ValueError(f"K = {k} is not divisible by k_leaves = {k_leaves}")


def leaf_partials(g: Gemms, x: torch.Tensor, weight: torch.Tensor, n_leaves: int) -> torch.Tensor:
    """fp32 partial products of `n_leaves` equal K-slices: [n_leaves, *x.shape[:-1], N].

    Each leaf is made contiguous before the GEMM, so a leaf's call sees the same
    shapes and strides whether x holds all of K (TP = 1) or one rank's share."""
    k = x.shape[-1]
    check_leaves(k, n_leaves)
    kl = k // n_leaves
    lead, n = x.shape[:-1], weight.shape[0]
    xs = x.reshape(-1, n_leaves, kl).transpose(0, 1).contiguous()  # [L, M, kl]
    ws = weight.reshape(n, n_leaves, kl).transpose(0, 1).contiguous()  # [L, N, kl]
    parts = torch.stack([g.linear(xs[i], ws[i]).float() for i in range(n_leaves)])
    return parts.reshape(n_leaves, *lead, n)


def linear_k_leaves(g: Gemms, x: torch.Tensor, weight: torch.Tensor, k_leaves: int) -> torch.Tensor:
    """y = x @ weight^T with the reduction over K cut into `k_leaves` leaves summed by a
    fixed fp32 tree; output in x's dtype. Equal, bit for bit, to the row-parallel form
    (titan_rl.parallel.tp_linear.row_parallel_linear) on any TP degree dividing k_leaves."""
    return g.tree_sum(leaf_partials(g, x, weight, k_leaves)).to(x.dtype)


class _ColumnBlocks(torch.autograd.Function):
    """`linear_n_blocks` with a backward of fixed-shape pieces. Each block j's weight
    gradient is its own GEMM (grad_j^T @ x); the input gradient is the sum over blocks of
    grad_j @ W_j ([M, N/n] x [N/n, K], the same call on every layout), upcast to fp32 and
    added by the tree, then passed to `finish` (None: this call holds the whole tree;
    under TP a rank holds one subtree and `finish` completes the same tree over ranks)."""

    @staticmethod
    def forward(ctx, x2, weight, n_blocks, finish, g):
        ctx.save_for_backward(x2, weight)
        ctx.n_blocks, ctx.finish, ctx.g = n_blocks, finish, g
        t = weight.shape[0] // n_blocks
        return torch.cat([g.mm(x2, weight[j * t:(j + 1) * t]) for j in range(n_blocks)], -1)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        g, t = ctx.g, weight.shape[0] // ctx.n_blocks
        grad = grad.to(x2.dtype)
        blocks = [grad[:, j * t:(j + 1) * t].contiguous() for j in range(ctx.n_blocks)]
        gx = gw = None
        if ctx.needs_input_grad[0]:
            w = weight.to(x2.dtype)
            sub = g.tree_sum(torch.stack([g.grad_input(b, w[j * t:(j + 1) * t]).float() for j, b in enumerate(blocks)]))
            gx = (sub if ctx.finish is None else ctx.finish(sub)).to(x2.dtype)
        if ctx.needs_input_grad[1]:
            gw = torch.cat([g.grad_weight(b, x2) for b in blocks]).to(weight.dtype)
        return gx, gw, None, None, None


def linear_n_blocks(g: Gemms, x: torch.Tensor, weight: torch.Tensor, n_blocks: int,
                    finish: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """y = x @ weight^T computed as `n_blocks` calls of the form's linear, one per block of
    weight.shape[0] / n_blocks consecutive output columns. A column's bits then depend
    only on its block, so a TP rank holding blocks [i, j) reproduces them. The input
    gradient is the blocks' partials added by a fixed fp32 tree (`_ColumnBlocks`);
    `finish(subtree_sum)` completes it across TP ranks (the column-parallel form)."""
    n = weight.shape[0]
    if n_blocks < 1 or n % n_blocks or n_blocks & (n_blocks - 1):
        raise ValueError(f"N = {n} is not divisible by n_blocks = {n_blocks} (a power of two)")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        lead = x.shape[:-1]
        return _ColumnBlocks.apply(x.reshape(-1, x.shape[-1]), weight, n_blocks, finish, g).reshape(*lead, n)
    if n_blocks == 1:
        return g.linear(x, weight)
    t = n // n_blocks
    return torch.cat([g.linear(x, weight[j * t:(j + 1) * t]) for j in range(n_blocks)], -1)
