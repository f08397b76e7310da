"""Batch-invariant linear on CPU: every GEMM call has the same shape.

Why (measured on the project's CPUs, see docs/kernels.md): MKL (fp32) and oneDNN
(bf16) pick kernels, K-blocking and thread splits from the call's M, so a row's bits
depend on how many rows share the call; padding M to a multiple of 4/16/32/64 does not
fix it. What does: slicing the rows into tiles of exactly ROW_TILE rows (zero-padding
the last) and issuing one GEMM per tile. Every call then has the same (M, K, N), the
library takes the same path, and a row's result depends only on its own values. The
guard test (tests/test_invariance_guard.py) sweeps rows, K, N, dtype and threads and
the start-up self-check (kernels/selfcheck.py) refuses exact mode where this fails.

Only the forward must be invariant (it produces the log-probs both engines compare).
The backward is the ordinary full-size GEMMs: the same gradient up to rounding, and
as fast as the stock path.
"""

import torch

ROW_TILE = 64


def _tiled_mm(x2: torch.Tensor, weight: torch.Tensor, row_tile: int) -> torch.Tensor:
    m, k = x2.shape
    pad = (-m) % row_tile if m else row_tile
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, k)])
    wt = weight.t()
    out = x2.new_empty(x2.shape[0], weight.shape[0])
    for i in range(0, x2.shape[0], row_tile):
        torch.mm(x2[i : i + row_tile], wt, out=out[i : i + row_tile])
    return out[:m]


class _InvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, row_tile):
        ctx.save_for_backward(x2, weight)
        return _tiled_mm(x2, weight, row_tile)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        gw = grad.t() @ x2 if ctx.needs_input_grad[1] else None
        return gx, gw, None


def linear(x: torch.Tensor, weight: torch.Tensor, row_tile: int = ROW_TILE) -> torch.Tensor:
    """y = x @ weight^T with each output row independent of the number of rows."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _InvariantLinear.apply(x2, weight, row_tile)
    else:
        y = _tiled_mm(x2, weight, row_tile)
    return y.reshape(*lead, weight.shape[0])


# -- fixed-shape pieces: the same bits for any tensor-parallel degree ---------------------
#
# Tensor parallelism (TP = t) gives each rank a slice of a linear. Two things then change
# a token's bits unless every GEMM call has a shape that does not depend on t:
#   * column-parallel (q/k/v/gate/up, output columns split): `linear` pins M, not N, and
#     MKL/oneDNN choose blocking and thread splits from N, so a rank's N/t-column call can
#     round differently from the full call. `linear_n_blocks` cuts N into L fixed blocks,
#     one call each; a rank holding L/t whole blocks issues the same calls.
#   * row-parallel (o/down, reduction dim K split): summing the ranks' partial GEMMs adds
#     in another order than one GEMM. `linear_k_leaves` cuts K into L leaves (one `linear`
#     call each on a contiguous [rows, K/L] x [K/L, N] problem, upcast to fp32) combined
#     by a balanced pairwise tree ((l0+l1)+(l2+l3))+...; a rank owns L/t consecutive
#     leaves = one whole subtree, and the ranks finish the same tree
#     (titan_rl/titan/tp_linear.py).
# L (the model's `tp_leaves`) does not depend on t, so TP = 1, 2, ..., L and the rollout
# engine (TP = 1) compute identical bits. Both forms stay batch-invariant: every piece is
# a call of `linear`, and the tree adds elementwise.

def _check_leaves(k: int, k_leaves: int) -> None:
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
    _check_leaves(k, n_leaves)
    kl = k // n_leaves
    lead, n = x.shape[:-1], weight.shape[0]
    xs = x.reshape(-1, n_leaves, kl).transpose(0, 1).contiguous()  # [L, M, kl]
    ws = weight.reshape(n, n_leaves, kl).transpose(0, 1).contiguous()  # [L, N, kl]
    parts = torch.stack([linear(xs[i], ws[i]).float() for i in range(n_leaves)])
    return parts.reshape(n_leaves, *lead, n)


def linear_k_leaves(x: torch.Tensor, weight: torch.Tensor, k_leaves: int) -> torch.Tensor:
    """y = x @ weight^T with the reduction over K cut into `k_leaves` leaves summed by a
    fixed fp32 tree; output in x's dtype. Equal, bit for bit, to the row-parallel form
    (titan_rl.titan.tp_linear.row_parallel_linear) on any TP degree dividing k_leaves."""
    return tree_sum(leaf_partials(x, weight, k_leaves)).to(x.dtype)


def linear_n_blocks(x: torch.Tensor, weight: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """y = x @ weight^T computed as `n_blocks` calls of `linear`, one per block of
    weight.shape[0] / n_blocks consecutive output columns. A column's bits then depend
    only on its block, so a TP rank holding blocks [i, j) reproduces them."""
    n = weight.shape[0]
    if n_blocks < 1 or n % n_blocks:
        raise ValueError(f"N = {n} is not divisible by n_blocks = {n_blocks}")
    if n_blocks == 1:
        return linear(x, weight)
    t = n // n_blocks
    return torch.cat([linear(x, weight[j * t:(j + 1) * t]) for j in range(n_blocks)], -1)
