"""Qwen3.5 (text): config.py, model.py (Qwen3-Next's layers, unfused GDN projections, dense
MLP), parallelize.py (its TP plan), spec.py."""

from titan_rl.models.qwen3_5.config import FLAVORS, Qwen35Config
from titan_rl.models.qwen3_5.model import Qwen35ForCausalLM
from titan_rl.models.qwen3_5.spec import SPEC, build

__all__ = ["FLAVORS", "SPEC", "Qwen35Config", "Qwen35ForCausalLM", "build"]
