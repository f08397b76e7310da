"""Qwen3-MoE: config.py, model.py (the dense decoder with a routed MLP), parallelize.py, spec.py."""

from titan_rl.models.qwen3_moe.config import FLAVORS, Qwen3MoeConfig
from titan_rl.models.qwen3_moe.model import Qwen3MoeForCausalLM
from titan_rl.models.qwen3_moe.spec import SPEC, build

__all__ = ["FLAVORS", "SPEC", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "build"]
