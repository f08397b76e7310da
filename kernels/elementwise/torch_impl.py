"""Elementwise ops on CPU with every element's bits independent of its position in the
buffer, the buffer's size and the thread count.

Why this is needed: ATen's vectorised loops compute the tail of a buffer (and of each
thread's chunk) on a scalar path whose transcendentals round differently from the SIMD
ones. With a width that is not a multiple of the vector length (intermediate 200: 7 of
the row counts 1..50 changed a row's F.silu bits), a row's activation then depends on
how many rows share the call.

* `silu_mul(gate, up)` = silu(gate) * up: compiled (kernels/csrc/elementwise.cpp), every
  element through the same IEEE operations and polynomial exp. Its backward is compiled
  too (`silu_mul_backward`, every element alone in fp32): a TP rank holds half of each
  row, and its gradient must be the unsharded one's bits (training is layout-invariant,
  not only the forward); one call instead of a dozen torch ops.
* RoPE: cos/sin come from a per-process table built in chunks of exactly TABLE_CHUNK
  positions (every chunk one call of the same shape, so a position's cos/sin bits are
  the same whichever forward first needed it); the rotation (multiplies and adds) is one
  compiled call reading each token's table row (kernels/csrc/rowwise.cpp).
"""

from __future__ import annotations

import torch

from titan_rl.kernels.cpu_ext import ops as _ops

TABLE_CHUNK = 512


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _ops().silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return _ops().silu_mul_backward(grad.to(gate.dtype), gate, up)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (HF's act_fn(gate_proj(x)) * up_proj(x)), row-invariant. gate and up
    may be the two halves of one GEMM output (read in place, no copy)."""
    lead, width = gate.shape[:-1], gate.shape[-1]
    g2, u2 = gate.reshape(-1, width), up.reshape(-1, width)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(g2, u2).reshape(*lead, width)
    return _ops().silu_mul(g2, u2).reshape(*lead, width)


# (d, theta, device) -> [cos fp32 [n, d], sin fp32 [n, d], {dtype or ("negated_sin", dtype): (cos, sin)}]
_TABLES: dict = {}


def _table(d: int, theta: float, n: int, device) -> list:
    key = (d, float(theta), str(device))
    t = _TABLES.get(key)
    if t is None or t[0].shape[0] < n:
        have = 0 if t is None else t[0].shape[0]
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        cos, sin = ([] if t is None else [t[0]]), ([] if t is None else [t[1]])
        for start in range(have, -(-n // TABLE_CHUNK) * TABLE_CHUNK, TABLE_CHUNK):
            pos = torch.arange(start, start + TABLE_CHUNK, device=device).float()
            emb = torch.cat([pos[:, None] * inv_freq[None, :]] * 2, -1)
            cos.append(emb.cos())
            sin.append(emb.sin())
        t = [torch.cat(cos), torch.cat(sin), {}]
        _TABLES[key] = t
    return t


def rope_tables(positions: torch.Tensor, d: int, theta: float, dtype: torch.dtype, negated_sin: bool = False):
    """The cos/sin tables [P, d] in `dtype` (HF: computed in fp32, cast) covering positions;
    negated_sin: -sin instead (the backward's rotation)."""
    n = int(positions.max()) + 1 if positions.numel() else 1
    t = _table(d, theta, n, positions.device)
    if dtype not in t[2] or t[2][dtype][0].shape[0] != t[0].shape[0]:
        t[2][dtype] = (t[0].to(dtype), t[1].to(dtype))
    if not negated_sin:
        return t[2][dtype]
    key = ("negated_sin", dtype)
    if key not in t[2] or t[2][key][0].shape[0] != t[0].shape[0]:
        t[2][key] = (t[2][dtype][0], -t[2][dtype][1])
    return t[2][key]


def rope_cos_sin(positions: torch.Tensor, d: int, theta: float, dtype: torch.dtype):
    """cos, sin [T, 1, d] for the positions, in `dtype`."""
    cos, sin = rope_tables(positions, d, theta, dtype)
    idx = positions.long()
    return cos[idx][:, None, :], sin[idx][:, None, :]


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, theta):
        ctx.save_for_backward(positions)
        ctx.theta = theta
        cos, sin = rope_tables(positions, x.shape[-1], theta, x.dtype)
        return _ops().rope(x, cos, sin, positions)

    @staticmethod
    def backward(ctx, grad):
        # y = x*c + rot(x)*s, rot(x) = [-x2, x1]: dx = g*c + rot^T(g*s) = g*c + rot(g)*(-s),
        # since s's halves are equal (HF's [freqs, freqs]): the same compiled rotation with the
        # sine negated, each product and the sum rounded as the eager form rounds them
        (positions,) = ctx.saved_tensors
        cos, neg_sin = rope_tables(positions, grad.shape[-1], ctx.theta, grad.dtype, negated_sin=True)
        return _ops().rope(grad, cos, neg_sin, positions), None, None


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (HF semantics: x*cos + rot(x)*sin, each product rounded to x's
    dtype) on x [T, heads, d]: one compiled call, cos/sin rows read from the table."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, positions, theta)
    cos, sin = rope_tables(positions, x.shape[-1], theta, x.dtype)
    return _ops().rope(x, cos, sin, positions)
