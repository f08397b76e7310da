"""SwiGLU activation and RoPE in Triton: the semantics of torch_impl, every element
through the same instructions wherever it sits.

* silu_mul(gate, up): one program per BLOCK elements of the flat buffer; silu in fp32
  (g / (1 + exp(-g))), rounded to the input dtype, times up, rounded once (HF's
  act_fn(gate) * up). No scalar tail path: masked lanes run the same code.
* rope(x [T, heads, d], positions, theta): one program per (token, head); cos/sin rows
  are read from torch_impl's per-process table (built in chunks of a fixed shape, so a
  position's cos/sin bits do not depend on which call needed it); each product is
  rounded to x's dtype and the sum once more (torch_impl's rule).
Backward: the gradient of the same functions in eager torch (kernels/autograd.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from titan_rl.kernels.autograd import with_eager_backward
from titan_rl.kernels.elementwise.torch_impl import rope_cos_sin, rope_tables

BLOCK = 1024  # elements per program; fixed


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, row-invariant."""
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, BLOCK),)](g, u, y, n, BLOCK=BLOCK, enable_fp_fusion=False)
    return y


def _silu_mul_eager(gate, up):
    return F.silu(gate) * up


silu_mul = with_eager_backward(_silu_mul, _silu_mul_eager)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, y_ptr, HEADS, D, sx_t, sx_h, sc, sy_t, sy_h,
                 BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    t = pid // HEADS
    h = pid % HEADS
    half = D // 2
    dd = tl.arange(0, BLOCK_D)
    mask = dd < D
    p = tl.load(pos_ptr + t)
    x = tl.load(x_ptr + t * sx_t + h * sx_h + dd, mask=mask, other=0.0)
    # rot(x) = [-x2, x1]: lane d reads lane d + half (first half, negated) or d - half.
    partner = tl.where(dd < half, dd + half, dd - half)
    xr = tl.load(x_ptr + t * sx_t + h * sx_h + partner, mask=mask, other=0.0).to(tl.float32)
    xr = tl.where(dd < half, -xr, xr)  # negated in fp32 (exact; the interpreter's bf16 negation is not)
    c = tl.load(cos_ptr + p * sc + dd, mask=mask, other=0.0)
    s = tl.load(sin_ptr + p * sc + dd, mask=mask, other=0.0)
    a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
    b = (xr * s.to(tl.float32)).to(x.dtype)
    y = a.to(tl.float32) + b.to(tl.float32)
    tl.store(y_ptr + t * sy_t + h * sy_h + dd, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on x [T, heads, d] at `positions` [T]."""
    T, heads, d = x.shape
    cos, sin = rope_tables(positions, d, theta, x.dtype)
    xc = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(T, heads, d, dtype=x.dtype, device=x.device)
    if T * heads:
        _rope_kernel[(T * heads,)](xc, cos, sin, positions.contiguous(), y, heads, d, xc.stride(0), xc.stride(1),
                                   cos.stride(0), y.stride(0), y.stride(1), BLOCK_D=triton.next_power_of_2(d),
                                   enable_fp_fusion=False)
    return y


def _rope_eager(x, positions, theta):
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, x.dtype)
    d = x.shape[-1]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


rope = with_eager_backward(_rope, _rope_eager)
