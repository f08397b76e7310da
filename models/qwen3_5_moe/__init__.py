"""Qwen3.5-MoE (text): config.py, model.py, parallelize.py (its TP plan), spec.py."""

from titan_rl.models.qwen3_5_moe.config import FLAVORS, Qwen35MoeConfig
from titan_rl.models.qwen3_5_moe.model import Qwen35MoeForCausalLM
from titan_rl.models.qwen3_5_moe.spec import SPEC, build

__all__ = ["FLAVORS", "SPEC", "Qwen35MoeConfig", "Qwen35MoeForCausalLM", "build"]
