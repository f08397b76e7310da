"""Sums in a fixed order (`fixed_sum`): the same bits for any thread count, tensor shape or
layout; the reductions of the training step's loss, gradient norm and metrics."""

from titan_rl.kernels.reduction.torch_impl import LANES, fixed_sum

__all__ = ["LANES", "fixed_sum"]
