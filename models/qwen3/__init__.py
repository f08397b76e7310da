"""Qwen3 dense: config.py (architecture config, flavors, config.json), model.py (the maths),
parallelize.py (the TP plan), spec.py (the ArchitectureSpec both engines read)."""

from titan_rl.models.qwen3.config import FLAVORS, Qwen3Config
from titan_rl.models.qwen3.model import Qwen3ForCausalLM
from titan_rl.models.qwen3.spec import SPEC, build

__all__ = ["FLAVORS", "SPEC", "Qwen3Config", "Qwen3ForCausalLM", "build"]
