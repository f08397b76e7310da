"""The GDN hybrid's ArchitectureSpec: its own vLLM wrapper (the GDN layers' states live in
vLLM's state cache) and no stock implementation with these weights."""

from __future__ import annotations

from titan_rl.models.arch_spec import ArchitectureSpec
from titan_rl.models.options import ModelOptions
from titan_rl.models.qwen3.config import resolve_config
from titan_rl.models.qwen3_hybrid.config import FLAVORS, Qwen3HybridConfig
from titan_rl.models.qwen3_hybrid.model import Qwen3HybridForCausalLM
from titan_rl.models.qwen3_hybrid.parallelize import TP_PLAN


def build(flavor: str | Qwen3HybridConfig = "debug_hybrid", options: ModelOptions = ModelOptions(),
          **overrides) -> Qwen3HybridForCausalLM:
    return Qwen3HybridForCausalLM(resolve_config(flavor, FLAVORS, "qwen3_hybrid", Qwen3HybridConfig, **overrides),
                                  options)


SPEC = ArchitectureSpec(
    name="qwen3_hybrid",
    model_class=Qwen3HybridForCausalLM,
    build=build,
    flavors=FLAVORS,
    config_from_hf=Qwen3HybridConfig.from_hf,
    config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
    vllm_architecture="TitanQwen3HybridForCausalLM",
    hf_architecture="TitanQwen3HybridForCausalLM",  # no stock implementation with these weights
    vllm_class="titan_rl.vllm.hybrid:TitanHybridForCausalLM",
    tp_plan=TP_PLAN,
    recurrent_state=True,
)
