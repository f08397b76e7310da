"""The GDN hybrid: config.py, model.py (the common GDN layers + full attention),
parallelize.py, spec.py; docs/gdn.md explains the layer."""

from titan_rl.models.qwen3_hybrid.config import FLAVORS, Qwen3HybridConfig
from titan_rl.models.qwen3_hybrid.model import Qwen3HybridForCausalLM
from titan_rl.models.qwen3_hybrid.spec import SPEC, build

__all__ = ["FLAVORS", "SPEC", "Qwen3HybridConfig", "Qwen3HybridForCausalLM", "build"]
