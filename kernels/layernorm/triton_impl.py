"""LayerNorm in Triton: torch_impl.layer_norm's contract (nn.LayerNorm's semantics, fp32
inside, one rounding to x's dtype).

One program per row, the whole row in one block of BLOCK_N = next_power_of_2(N) lanes:
mean = sum(x) / N, var = sum((x - mean)^2) / N, y = ((x - mean) * (1 / sqrt(var + eps))) * w + b.
Masked lanes add exactly 0 to both sums (their centred value is forced to 0, not -mean).
The reduction tree is a function of N only and a program never reads another row, so a row's
bits do not depend on how many rows share the call (no split reduction). The tree is not the
CPU kernel's 16-lane one: the two backends agree to the stated tolerance, not bit for bit.
sqrt and the divisions are the correctly rounded forms (tl.sqrt_rn, tl.div_rn), not the GPU's
approximate ones; fp-fusion is off so no multiply-add is contracted into an FMA.
Backward: the gradient of layer_norm_eager (kernels/autograd.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_rl.kernels.autograd import with_eager_backward
from titan_rl.kernels.layernorm.torch_impl import layer_norm_eager


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, n_float, stride_x, stride_y, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.div_rn(tl.sum(x, axis=0), n_float)
    c = tl.where(mask, x - mean, 0.0)
    var = tl.div_rn(tl.sum(c * c, axis=0), n_float)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (c * rstd) * w + b
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    if weight.numel() != n or bias.numel() != n:
        raise ValueError(f"layer_norm: weight / bias need {n} elements, got {weight.numel()} / {bias.numel()}")
    x2 = x.reshape(-1, n).contiguous()
    w = weight.contiguous()
    b = bias.to(weight.dtype).contiguous()  # the CPU kernel reads the bias in the weight's dtype
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        _layer_norm_kernel[(x2.shape[0],)](x2, w, b, y, n, float(n), x2.stride(0), y.stride(0), eps,
                                           BLOCK_N=triton.next_power_of_2(n), enable_fp_fusion=False)
    return y.reshape(x.shape)


layer_norm = with_eager_backward(_layer_norm, layer_norm_eager)
