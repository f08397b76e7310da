"""Batch-invariant linear in Triton: the same algorithm as torch_impl.linear.

Each program owns one fixed tile of BLOCK_M output rows x BLOCK_N output columns and
walks K in BLOCK_K steps from k = 0 upwards, accumulating in fp32. The tile sizes are
constants (never chosen from M) and there is no split-K, so an output element is the
same sequence of operations on the same operands whatever the number of rows: a row's
bits cannot depend on M. Masked loads pad with 0, which adds exactly 0 to the sum.

input_precision="ieee": fp32 operands get full fp32 products (no TF32), like the torch
path; bf16 operands are unaffected (native bf16 dot, fp32 accumulate). Every launch pins
enable_fp_fusion=False (mul and add rounded separately, as in eager torch; otherwise the
TRITON_DEFAULT_FP_FUSION env var, whose default changes in Triton 3.10, could compile the
trainer and the engine differently). No @triton.autotune: a config picked per M would
reintroduce exactly the M-dependence this kernel exists to remove.
Tested under TRITON_INTERPRET=1 in fp32 only (the interpreter's bf16 tl.dot is broken).
"""

import torch
import triton
import triton.language as tl

from titan_rl.kernels.matmul import blocks

ROW_TILE = 64  # BLOCK_M; same default as torch_impl.ROW_TILE
BLOCK_N = 64
BLOCK_K = 32


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count (no M == 1 or M % 16 variant)
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Fixed-order K loop: k = 0, BLOCK_K, 2*BLOCK_K, ... (no split-K, no atomics).
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :] * stride_wk,
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _linear(x: torch.Tensor, weight: torch.Tensor, row_tile: int = ROW_TILE) -> torch.Tensor:
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    y = x2.new_empty(m, n)
    if m and n:
        grid = (triton.cdiv(m, row_tile), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](x2, weight, y, m, n, k,
                             x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                             y.stride(0), y.stride(1),
                             BLOCK_M=row_tile, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, enable_fp_fusion=False)
    return y.reshape(*lead, n)


class _Linear(torch.autograd.Function):
    """Forward: the fixed-tile kernel. Backward: the ordinary GEMMs (only the forward
    has to match the engine)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        gx = grad @ weight.to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype) \
            if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x: torch.Tensor, weight: torch.Tensor, row_tile: int = ROW_TILE) -> torch.Tensor:
    """y = x @ weight^T, each output row independent of the number of rows.
    row_tile is the fixed BLOCK_M (a power of two >= 16 for tl.dot)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Linear.apply(x, weight)
    return _linear(x, weight, row_tile)


def gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """The engine's weight prepared once per load: detached and contiguous (the kernel
    reads any strides; contiguous rows load in full cache lines)."""
    return weight.detach().contiguous()


# -- the fixed-shape tensor-parallel pieces (kernels/matmul/blocks.py; why: torch_impl.py) ---

@triton.jit
def _pair_sum_kernel(src_ptr, dst_ptr, half, numel, BLOCK: tl.constexpr):
    # dst[i, e] = src[2i, e] + src[2i + 1, e] over flat (i, e), i < half: one level of the tree
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < half * numel
    i, e = offs // numel, offs % numel
    a = tl.load(src_ptr + (2 * i) * numel + e, mask=mask)
    b = tl.load(src_ptr + (2 * i + 1) * numel + e, mask=mask)
    # in fp32, rounded once to the parts' dtype: what torch's add does for bf16 / fp16 parts
    tl.store(dst_ptr + offs, (a.to(tl.float32) + b.to(tl.float32)).to(dst_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=mask)


PAIR_BLOCK = 1024


def tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """Balanced pairwise sum over dim 0 (a power of two): one launch per level, each adding
    neighbours elementwise (one IEEE add per element), so the bits are torch_impl.tree_sum's."""
    n = parts.shape[0]
    if n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two count, got {n}")
    numel = parts[0].numel()
    while parts.shape[0] > 1:
        src, half = parts.contiguous(), parts.shape[0] // 2
        dst = src.new_empty(half, *src.shape[1:])
        if numel:
            grid = (triton.cdiv(half * numel, PAIR_BLOCK),)
            _pair_sum_kernel[grid](src, dst, half, numel, BLOCK=PAIR_BLOCK, enable_fp_fusion=False)
        parts = dst
    return parts[0]


def _grad_input(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad [M, N] @ weight [N, K]: the fixed-tile kernel on the transposed weight (any strides)."""
    return _linear(grad, weight.to(grad.dtype).t())


def _grad_weight(grad: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """grad^T [N, M] @ x2 [M, K]: the fixed-tile kernel with the M rows as the reduction."""
    return _linear(grad.t(), x2.to(grad.dtype).t())


GEMMS = blocks.Gemms(linear=linear, mm=_linear, grad_input=_grad_input, grad_weight=_grad_weight, tree_sum=tree_sum)


def leaf_partials(x: torch.Tensor, weight: torch.Tensor, n_leaves: int) -> torch.Tensor:
    return blocks.leaf_partials(GEMMS, x, weight, n_leaves)


def linear_k_leaves(x: torch.Tensor, weight: torch.Tensor, k_leaves: int) -> torch.Tensor:
    return blocks.linear_k_leaves(GEMMS, x, weight, k_leaves)


def linear_n_blocks(x: torch.Tensor, weight: torch.Tensor, n_blocks: int, finish=None) -> torch.Tensor:
    return blocks.linear_n_blocks(GEMMS, x, weight, n_blocks, finish)
