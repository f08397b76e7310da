"""Batch-invariant linear on CPU: every GEMM call has the same shape.

Why (measured on the project's CPUs, see docs/kernels.md): MKL (fp32) and oneDNN
(bf16) pick kernels, K-blocking and thread splits from the call's M, so a row's bits
depend on how many rows share the call; padding M to a multiple of 4/16/32/64 does not
fix it. What does: slicing the rows into tiles of exactly ROW_TILE rows (zero-padding
the last) and issuing one GEMM per tile. Every call then has the same (M, K, N), the
library takes the same path, and a row's result depends only on its own values. The
guard test (tests/test_invariance_guard.py) sweeps rows, K, N, dtype and threads and
the start-up self-check (kernels/selfcheck.py) refuses exact mode where this fails.

Cost: one weight read per tile instead of per call; ~1.5x at decode sizes, ~2x for
long prefills (scripts/bench_parity_overhead.py). Only the forward needs invariance;
autograd differentiates through the tiles as usual.
"""

import torch

ROW_TILE = 64


def linear(x: torch.Tensor, weight: torch.Tensor, row_tile: int = ROW_TILE) -> torch.Tensor:
    """y = x @ weight^T with each output row independent of the number of rows."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    pad = (-m) % row_tile
    if pad or m == 0:
        x2 = torch.cat([x2, x2.new_zeros(pad if m else row_tile, k)])
    wt = weight.t()
    y = torch.cat([torch.mm(x2[i : i + row_tile], wt) for i in range(0, x2.shape[0], row_tile)])
    return y[:m].reshape(*lead, weight.shape[0])
