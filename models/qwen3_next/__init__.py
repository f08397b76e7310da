"""Qwen3-Next: config.py, model.py (GDN + gated attention + MoE with a shared expert),
parallelize.py, spec.py."""

from titan_rl.models.qwen3_next.config import FLAVORS, Qwen3NextConfig
from titan_rl.models.qwen3_next.model import Qwen3NextForCausalLM
from titan_rl.models.qwen3_next.spec import SPEC, build

__all__ = ["FLAVORS", "SPEC", "Qwen3NextConfig", "Qwen3NextForCausalLM", "build"]
