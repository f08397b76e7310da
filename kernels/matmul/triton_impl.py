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
