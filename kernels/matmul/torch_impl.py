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
