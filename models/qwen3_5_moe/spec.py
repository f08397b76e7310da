"""Qwen3.5-MoE's ArchitectureSpec (text-only): transformers' and vLLM's Qwen3_5MoeForCausalLM weights."""

from __future__ import annotations

from titan_rl.models.arch_spec import ArchitectureSpec
from titan_rl.models.options import ModelOptions
from titan_rl.models.qwen3.config import resolve_config
from titan_rl.models.qwen3_next.config import text_key
from titan_rl.models.qwen3_5_moe.config import FLAVORS, Qwen35MoeConfig
from titan_rl.models.qwen3_5_moe.model import Qwen35MoeForCausalLM
from titan_rl.models.qwen3_5_moe.parallelize import NO_TP_REASON


def build(flavor: str | Qwen35MoeConfig = "debug_qwen35_moe", options: ModelOptions = ModelOptions(),
          **overrides) -> Qwen35MoeForCausalLM:
    return Qwen35MoeForCausalLM(resolve_config(flavor, FLAVORS, "qwen3_5_moe", Qwen35MoeConfig, **overrides), options)


SPEC = ArchitectureSpec(
    name="qwen3_5_moe",
    model_class=Qwen35MoeForCausalLM,
    build=build,
    flavors=FLAVORS,
    config_from_hf=Qwen35MoeConfig.from_hf,
    config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
    vllm_architecture="TitanQwen3_5MoeForCausalLM",
    hf_architecture="Qwen3_5MoeForCausalLM",
    hf_aliases=("Qwen3_5MoeForConditionalGeneration",),  # its text model
    checkpoint_key=text_key,
    vllm_class="titan_rl.vllm.hybrid:TitanHybridForCausalLM",
    tp_plan=None,
    no_tp_reason=NO_TP_REASON,
    recurrent_state=True,
    moe=True,
)
