"""RMSNorm in Triton: the same algorithm as torch_impl.rms_norm.

One program per row, the whole row in one block of BLOCK_N = next_power_of_2(N) lanes
(masked lanes load 0 and add exactly 0 to the sum of squares). The reduction tree is a
function of N only, and a program never sees another row, so a row's bits cannot
depend on how many rows there are (no split reduction across programs).

Semantics as torch_impl: x -> fp32, mean of squares, multiply by rsqrt(ms + eps),
round to x.dtype, then multiply by weight with the result in the promoted dtype.
Backward: the gradient of rms_norm_eager (kernels/autograd.py).
"""

import torch
import triton
import triton.language as tl

from titan_rl.kernels.autograd import with_eager_backward
from titan_rl.kernels.matmul.triton_impl import tree_sum
from titan_rl.kernels.rmsnorm.torch_impl import head_rms_norm, rms_norm_eager


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, stride_y, eps,
                     BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=0) / N
    xn = (xf * tl.rsqrt(ms + eps)).to(x.dtype)  # round to the input dtype, as torch does
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * xn.to(tl.float32)  # one rounding, into the output dtype
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, n, x2.stride(0), y.stride(0), eps,
                                        BLOCK_N=triton.next_power_of_2(n), enable_fp_fusion=False)
    return y.reshape(x.shape)


rms_norm = with_eager_backward(_rms_norm, rms_norm_eager)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, gather=None) -> torch.Tensor:
    """torch_impl.rms_norm_heads on this form: the forward is rms_norm above, the weight
    gradient's tree over heads the Triton tree_sum (the same elementwise adds)."""
    return head_rms_norm(x, weight, eps, gather, rms_norm, tree_sum)
