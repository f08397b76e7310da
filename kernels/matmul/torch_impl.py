"""Batch-invariant linear on CPU.

Why (measured, docs/kernels.md): BLAS and oneDNN pick kernels, K-blocking and thread
splits from the call's M, so with plain F.linear a row's bits depend on how many rows
share the call. What is invariant on the project's CPUs (guard test, 1 and 2 threads,
M = 1..130 and 200/257/512/2000, odd K and N): ONE GEMM call with M zero-padded up to a
multiple of ROW_MULTIPLE (fewer rows take another kernel) and, for N < MIN_N, the weight
zero-padded to MIN_N rows (fp32 with an odd K and N <= 11 varied otherwise).

The GEMM (`GEMM`, chosen once per platform and reported by the self-check):
  "onednn": oneDNN's matmul on a weight reordered once into its blocked layout
            (torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise, what vLLM's
            CPU linears use): faster than torch.mm in fp32 (docs/kernels.md has the
            figures), invariant under the rule above;
  "mm":     torch.mm (BLAS), where torch has no oneDNN.
bf16 (`BF16_GEMM`): "native" bf16 GEMMs where the CPU has bf16 instructions; else "fp32":
operands upcast to fp32 (exact), an fp32 GEMM, rounded to bf16 (faster than a bf16 GEMM
without those instructions: docs/kernels.md).

The engine prepares each weight once per load (`PackedWeight`); the
trainer's weights change every step, so `linear` packs them per call (a copy of K*N
values, small beside the M*K*N GEMM). Both go through the same reorder and GEMM, so
both give the same bits. The backward's two GEMMs (`grad_input`, `grad_weight`) go
through the same GEMM too: torch.mm's own choice depends on the thread count (measured:
fp32 grad @ W at M = 5..11 rows, bf16 grad^T @ x at M = 2048, 1 vs 2 threads), and a
training step must give the same bits at any thread count (the layout tests and the
contract compare ranks that may run different counts). The fixed pieces below also fix
their backward's shapes, for TP-invariant gradients.
"""

from __future__ import annotations

from typing import Callable

import torch

ROW_MULTIPLE = 8
MIN_N = 16  # narrower weights are zero-padded to this many output columns


def _native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


GEMM = "onednn" if torch.backends.mkldnn.is_available() else "mm"
BF16_GEMM = "native" if GEMM == "onednn" and _native_bf16() else "fp32"


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the GEMM of a `dtype` linear runs in on this platform."""
    return torch.float32 if dtype == torch.bfloat16 and BF16_GEMM == "fp32" else dtype


class PackedWeight:
    """A [N, K] weight prepared for the GEMM: in the GEMM dtype, N padded to MIN_N, and
    (GEMM = "onednn") reordered into oneDNN's layout. Opaque: only `linear` reads it."""

    __slots__ = ("data", "n", "k", "gemm", "bf16_gemm")

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().to(gemm_dtype(weight.dtype)).contiguous()
        self.n, self.k = w.shape
        if self.n < MIN_N:
            w = torch.cat([w, w.new_zeros(MIN_N - self.n, self.k)])
        self.gemm, self.bf16_gemm = GEMM, BF16_GEMM
        self.data = torch.ops.mkldnn._reorder_linear_weight(w, None) if GEMM == "onednn" else w

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def _gemm(x2: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """x2 [M, K] (in the GEMM dtype) @ weight^T -> [M, N], M padded inside one call."""
    if (pw.gemm, pw.bf16_gemm) != (GEMM, BF16_GEMM):
        raise RuntimeError("PackedWeight was made under another GEMM choice; pack it again")
    m = x2.shape[0]
    pad = (-m) % ROW_MULTIPLE if m else ROW_MULTIPLE
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, pw.k)])
    if pw.gemm == "onednn":
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), pw.data, None, "none", [], "")
    else:
        y = torch.mm(x2, pw.data.t())
    return y[:m, : pw.n]


def _invariant_mm(x2: torch.Tensor, weight) -> torch.Tensor:
    """x2 [M, K] @ weight^T in x2's dtype; `weight` a tensor or a PackedWeight."""
    pw = weight if isinstance(weight, PackedWeight) else PackedWeight(weight)
    g = pw.dtype
    y = _gemm(x2 if x2.dtype == g else x2.to(g), pw)
    return y if y.dtype == x2.dtype else y.to(x2.dtype)


def grad_input(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad [M, N] @ weight [N, K] -> [M, K] in grad's dtype: the GEMM of `linear` on the
    transposed weight (rows padded the same way, so the bits depend on nothing but M)."""
    return _invariant_mm(grad, weight.to(grad.dtype).t())


def grad_weight(grad: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """grad [M, N]^T @ x2 [M, K] -> [N, K] in grad's dtype: the reduction over the M rows
    as `linear`'s GEMM (x = grad^T, weight = x2^T). M is zero-padded to ROW_MULTIPLE
    (oneDNN has no primitive for a reduction of 1; zero products leave every sum as is)."""
    m = grad.shape[0]
    pad = (-m) % ROW_MULTIPLE if m else ROW_MULTIPLE
    g, x = grad.t(), x2.to(grad.dtype).t()
    if pad:
        g = torch.cat([g, g.new_zeros(g.shape[0], pad)], 1)
        x = torch.cat([x, x.new_zeros(x.shape[0], pad)], 1)
    return _invariant_mm(g.contiguous(), x)


class _InvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight):
        ctx.save_for_backward(x2, weight)
        return _invariant_mm(x2, weight)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        grad = grad.to(x2.dtype)
        gx = grad_input(grad, weight) if ctx.needs_input_grad[0] else None
        gw = grad_weight(grad, x2).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """y = x @ weight^T in x's dtype, each output row independent of the number of rows.
    `weight`: [N, K] tensor, or a PackedWeight (engine, no autograd)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(weight, PackedWeight):
        y = _invariant_mm(x2, weight)
        n = weight.n
    else:
        n = weight.shape[0]
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            y = _InvariantLinear.apply(x2, weight)
        else:
            y = _invariant_mm(x2, weight)
    return y.reshape(*lead, n)


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
#     (titan_rl/parallel/tp_linear.py).
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
    (titan_rl.parallel.tp_linear.row_parallel_linear) on any TP degree dividing k_leaves."""
    return tree_sum(leaf_partials(x, weight, k_leaves)).to(x.dtype)


class _ColumnBlocks(torch.autograd.Function):
    """`linear_n_blocks` with a backward of fixed-shape pieces. Each block j's weight
    gradient is its own GEMM (grad_j^T @ x); the input gradient is the sum over blocks of
    grad_j @ W_j ([M, N/n] x [N/n, K], the same call on every layout), upcast to fp32 and
    added by `tree_sum`, then passed to `finish` (None: this call holds the whole tree;
    under TP a rank holds one subtree and `finish` completes the same tree over ranks)."""

    @staticmethod
    def forward(ctx, x2, weight, n_blocks, finish):
        ctx.save_for_backward(x2, weight)
        ctx.n_blocks, ctx.finish = n_blocks, finish
        t = weight.shape[0] // n_blocks
        return torch.cat([_invariant_mm(x2, weight[j * t:(j + 1) * t]) for j in range(n_blocks)], -1)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        t = weight.shape[0] // ctx.n_blocks
        grad = grad.to(x2.dtype)
        blocks = [grad[:, j * t:(j + 1) * t].contiguous() for j in range(ctx.n_blocks)]
        gx = gw = None
        if ctx.needs_input_grad[0]:
            w = weight.to(x2.dtype)
            sub = tree_sum(torch.stack([grad_input(g, w[j * t:(j + 1) * t]).float() for j, g in enumerate(blocks)]))
            gx = (sub if ctx.finish is None else ctx.finish(sub)).to(x2.dtype)
        if ctx.needs_input_grad[1]:
            gw = torch.cat([grad_weight(g, x2) for g in blocks]).to(weight.dtype)
        return gx, gw, None, None


def linear_n_blocks(x: torch.Tensor, weight: torch.Tensor, n_blocks: int,
                    finish: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """y = x @ weight^T computed as `n_blocks` calls of `linear`, one per block of
    weight.shape[0] / n_blocks consecutive output columns. A column's bits then depend
    only on its block, so a TP rank holding blocks [i, j) reproduces them. The input
    gradient is the blocks' partials added by a fixed fp32 tree (`_ColumnBlocks`);
    `finish(subtree_sum)` completes it across TP ranks (the column-parallel form)."""
    n = weight.shape[0]
    if n_blocks < 1 or n % n_blocks or n_blocks & (n_blocks - 1):
        raise ValueError(f"N = {n} is not divisible by n_blocks = {n_blocks} (a power of two)")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        lead = x.shape[:-1]
        return _ColumnBlocks.apply(x.reshape(-1, x.shape[-1]), weight, n_blocks, finish).reshape(*lead, n)
    if n_blocks == 1:
        return linear(x, weight)
    t = n // n_blocks
    return torch.cat([linear(x, weight[j * t:(j + 1) * t]) for j in range(n_blocks)], -1)
