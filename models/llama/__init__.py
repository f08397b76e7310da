"""Llama (Llama 3.x and SmolLM2 shapes): config.py (architecture config, flavors, config.json),
model.py (the maths: the common dense decoder without q/k norm), spec.py (the ArchitectureSpec).
Its TP plan is the dense decoder's (models/common/parallelize.py)."""

from titan_rl.models.llama.config import FLAVORS, LlamaConfig
from titan_rl.models.llama.model import LlamaForCausalLM
from titan_rl.models.llama.spec import SPEC, build

__all__ = ["FLAVORS", "SPEC", "LlamaConfig", "LlamaForCausalLM", "build"]
