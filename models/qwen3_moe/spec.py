"""Qwen3-MoE's ArchitectureSpec."""

from __future__ import annotations

from titan_rl.models.arch_spec import ArchitectureSpec
from titan_rl.models.options import ModelOptions
from titan_rl.models.qwen3.config import resolve_config
from titan_rl.models.qwen3_moe.config import FLAVORS, Qwen3MoeConfig
from titan_rl.models.qwen3_moe.model import Qwen3MoeForCausalLM
from titan_rl.models.qwen3_moe.parallelize import TP_PLAN


def build(flavor: str | Qwen3MoeConfig = "debug_moe", options: ModelOptions = ModelOptions(),
          **overrides) -> Qwen3MoeForCausalLM:
    return Qwen3MoeForCausalLM(resolve_config(flavor, FLAVORS, "qwen3_moe", Qwen3MoeConfig, **overrides), options)


SPEC = ArchitectureSpec(
    name="qwen3_moe",
    model_class=Qwen3MoeForCausalLM,
    build=build,
    flavors=FLAVORS,
    config_from_hf=Qwen3MoeConfig.from_hf,
    config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
    vllm_architecture="TitanQwen3MoeForCausalLM",
    hf_architecture="Qwen3MoeForCausalLM",
    tp_plan=TP_PLAN,
    moe=True,
)
