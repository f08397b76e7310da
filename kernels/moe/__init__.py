"""Mixture-of-experts routing and expert combination (see docs/moe.md). `router_topk` and
`moe_experts` are dispatched ops (kernels/dispatch.py: torch_impl on CPU, triton_impl on CUDA)."""

from titan_rl.kernels.dispatch import Dispatched
from titan_rl.kernels.moe.torch_impl import compact_routes, load_balancing_loss, swiglu_expert

router_topk = Dispatched("router_topk")
moe_experts = Dispatched("moe_experts")

__all__ = ["compact_routes", "load_balancing_loss", "moe_experts", "router_topk", "swiglu_expert"]
