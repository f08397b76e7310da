"""Sums in a fixed order (`fixed_sum`): the same bits for any thread count, tensor shape or
layout; the reductions of the training step's loss, gradient norm and metrics, and the
gradients of broadcast parameters (`broadcast_rows`)."""

from titan_rl.kernels.reduction.torch_impl import LANES, broadcast_rows, fixed_sum

__all__ = ["LANES", "broadcast_rows", "fixed_sum"]
