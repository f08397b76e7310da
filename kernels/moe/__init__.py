"""Mixture-of-experts routing and expert combination (see docs/moe.md)."""

from titan_rl.kernels.moe.torch_impl import compact_routes, load_balancing_loss, moe_experts, router_topk, swiglu_expert

__all__ = ["compact_routes", "load_balancing_loss", "moe_experts", "router_topk", "swiglu_expert"]
