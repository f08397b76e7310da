"""Mixture-of-experts routing and expert combination (see docs/moe.md). `router_topk` and
`moe_experts` are dispatched ops (kernels/dispatch.py: torch_impl on CPU, triton_impl on CUDA)."""

from titan_rl.kernels.dispatch import moe_experts, router_sigmoid_topk, router_topk
from titan_rl.kernels.moe.torch_impl import compact_routes, load_balancing_loss, swiglu_expert, topk_ties_low

__all__ = ["compact_routes", "load_balancing_loss", "moe_experts", "router_sigmoid_topk", "router_topk", "swiglu_expert",
           "topk_ties_low"]
