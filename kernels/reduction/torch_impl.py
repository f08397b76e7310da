"""fixed_sum: a sum whose order is fixed by the elements' indices alone.

Why: torch's CPU `sum` splits a large reduction into per-thread chunks and adds their
partials, so its bits change with the thread count (a gradient norm over a ~262k-element
embedding did at 1 vs 2 threads); vectorised loops also make a tail's order depend on the
length. Here the reduced elements, in index order, are cut in rows of LANES (zero-padded),
each row is halved by elementwise adds (contiguous halves, log2 LANES levels), and the row
sums are added pairwise, neighbours first, an odd last one carried to the next level. Only
elementwise IEEE adds: the result depends on the values and the number of elements, never
on threads, strides or how the tensor was laid out. Differentiable (adds and pads), any
device. Cost: a few elementwise passes over the input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LANES = 2048


def _rows_tree(x: torch.Tensor) -> torch.Tensor:
    """[n, ...] -> [...]: neighbours added pairwise, level by level (odd last one carried)."""
    while x.shape[0] > 1:
        n = x.shape[0]
        pairs = x[0:n - n % 2:2] + x[1:n:2]
        x = torch.cat([pairs, x[n - 1:]]) if n % 2 else pairs
    return x[0]


def _lanes_tree(x: torch.Tensor) -> torch.Tensor:
    """[..., w] (w a power of two) -> [...]: halved by adding the two contiguous halves."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def fixed_sum(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sum of `x` (dim None: all elements, a 0-d tensor) or over `dim`, in x's dtype,
    in the fixed order above. An empty reduction is 0."""
    if dim is None:
        flat = x.reshape(-1)
        n = flat.numel()
        if n == 0:
            return flat.new_zeros(())
        rows = -(-n // LANES)
        flat = F.pad(flat, (0, rows * LANES - n))
        return _rows_tree(_lanes_tree(flat.view(rows, LANES)))
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    width = LANES if n > LANES else 1 << (n - 1).bit_length()
    rows = -(-n // width)
    x = F.pad(x, (0, rows * width - n))
    return _rows_tree(_lanes_tree(x.reshape(*x.shape[:-1], rows, width)).movedim(-1, 0))


class _BroadcastRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, n):
        return p.expand(n, *p.shape)

    @staticmethod
    def backward(ctx, grad):
        return fixed_sum(grad, dim=0), None


def broadcast_rows(p: torch.Tensor, n: int) -> torch.Tensor:
    """p [...] as [n, ...] (an expanded view) whose gradient is summed over the n rows by
    `fixed_sum`: the order depends on n alone. Autograd's own broadcast reduction does not:
    its order changes with p's width, so a per-head or per-channel parameter on a TP rank
    (half the heads) would get other gradient bits than unsharded."""
    return _BroadcastRows.apply(p, n)
