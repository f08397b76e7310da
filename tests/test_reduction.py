"""kernels.reduction.fixed_sum: close to the fp64 sum (a bound that holds for any input) and
the same bits at every thread count, for any shape the same elements are held in, and
for a row alone or among others (dim=); its gradient is the sum's (exactly 1)."""

import math
import os

import pytest
import torch
from _threads import threads

from titan_rl.kernels.reduction import LANES, broadcast_rows, fixed_sum
from titan_rl.kernels.reduction.reference import sum_reference

THREADS = [1, 2] + ([4] if (os.cpu_count() or 1) >= 4 else [])


def _bound(x: torch.Tensor, n: int) -> float:
    """Pairwise summation's error: at most (levels + 1) unit roundoffs of sum |x|."""
    u = torch.finfo(x.dtype).eps / 2
    return (math.ceil(math.log2(max(n, 2))) + 1) * u * float(x.double().abs().sum())


@pytest.mark.parametrize("n", [1, 7, LANES - 1, LANES, LANES + 1, 3 * LANES + 5, 262_147])
def test_close_to_the_fp64_sum_and_the_same_at_every_thread_count(n, rng):
    x = torch.randn(n, generator=rng) * torch.rand(n, generator=rng).mul(6).exp()
    outs = []
    for t in THREADS:
        with threads(t):
            outs.append(fixed_sum(x))
    assert all(torch.equal(o, outs[0]) for o in outs), [float(o) for o in outs]
    assert abs(float(outs[0]) - float(sum_reference(x))) <= _bound(x, n)


def test_order_is_the_flat_index_whatever_the_shape(rng):
    x = torch.randn(6 * 1009, generator=rng)
    want = fixed_sum(x)
    for shape in ((6, 1009), (1009, 6), (2, 3, 1009)):
        assert torch.equal(fixed_sum(x.view(shape)), want), shape
    # a transposed (non-contiguous) view holds the same elements in another index order:
    # equal to the sum of its own contiguous copy
    y = x.view(6, 1009).t()
    assert torch.equal(fixed_sum(y), fixed_sum(y.contiguous()))


@pytest.mark.parametrize("width", [1, 5, 200, LANES + 3, 3 * LANES])
def test_dim_rows_do_not_depend_on_the_other_rows(width, rng):
    x = torch.randn(13, width, generator=rng)
    full = fixed_sum(x, 1)
    for rows in (slice(0, 1), slice(3, 4), slice(5, 13)):
        assert torch.equal(fixed_sum(x[rows], 1), full[rows])
    assert torch.equal(fixed_sum(x.t().contiguous(), 0), full)
    ref = sum_reference(x, 1)
    assert all(abs(float(a) - float(b)) <= _bound(r, width) for a, b, r in zip(full, ref, x))


def test_empty_and_gradient(rng):
    assert float(fixed_sum(torch.zeros(0))) == 0.0
    assert fixed_sum(torch.zeros(3, 0), 1).shape == (3,)
    x = torch.randn(4, 700, generator=rng, requires_grad=True)
    (fixed_sum(x) * 3).backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    x.grad = None
    fixed_sum(x, 1).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_torch_sum_does_depend_on_threads_here_and_fixed_sum_does_not():
    """Why fixed_sum exists: torch's own sum of a large tensor splits by thread, fixed_sum gives
    the same bits for the same tensors. Skipped (not failed) where this machine's torch.sum
    happens not to split."""
    g = torch.Generator().manual_seed(0)
    differ = 0
    for _ in range(10):
        x = torch.randn(262_144, generator=g)
        with threads(1):
            a, fa = x.sum(), fixed_sum(x)
        with threads(2):
            differ += not torch.equal(a, x.sum())
            assert torch.equal(fa, fixed_sum(x))
    if not differ:
        pytest.skip("torch.sum gave the same bits at 1 and 2 threads for all 10 tensors")
    assert differ >= 1


@pytest.mark.parametrize("n", [1, 37, 3001])
def test_a_broadcast_parameters_gradient_does_not_depend_on_its_width(n, rng):
    """A per-head parameter broadcast over n tokens: its gradient is a fixed sum over the
    tokens, the same bits for all heads or for a TP rank's half of them (autograd's own
    broadcast reduction changes order with the width), and close to the fp64 sum."""
    p = torch.randn(6, generator=rng, dtype=torch.float64).float()
    w = torch.randn(n, 6, generator=rng)

    def grad(cols):
        q = p[cols].clone().requires_grad_()
        (broadcast_rows(q, n) * w[:, cols]).sum().backward()
        return q.grad

    full = grad(slice(None))
    assert torch.equal(torch.cat([grad(slice(0, 3)), grad(slice(3, 6))]), full)
    assert torch.equal(grad(slice(2, 3)), full[2:3])
    torch.testing.assert_close(full.double(), w.double().sum(0), rtol=1e-5, atol=1e-5 * n ** 0.5)
    assert torch.equal(broadcast_rows(p, n), p.expand(n, 6))
