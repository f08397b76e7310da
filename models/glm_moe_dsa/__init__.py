"""GLM-5 (transformers' glm_moe_dsa): config.py, model.py (MLA + DeepSeek sparse attention +
sigmoid-routed MoE), parallelize.py (no TP plan yet, and why), spec.py."""

from titan_rl.models.glm_moe_dsa.config import FLAVORS, GlmDsaConfig
from titan_rl.models.glm_moe_dsa.model import DenseLatents, GlmMoeDsaForCausalLM
from titan_rl.models.glm_moe_dsa.spec import SPEC, build

__all__ = ["FLAVORS", "SPEC", "DenseLatents", "GlmDsaConfig", "GlmMoeDsaForCausalLM", "build"]
