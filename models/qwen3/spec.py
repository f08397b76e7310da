"""Qwen3's ArchitectureSpec: what TorchTitan and vLLM need to know of it."""

from __future__ import annotations

from titan_rl.models.arch_spec import ArchitectureSpec
from titan_rl.models.options import ModelOptions
from titan_rl.models.qwen3.config import FLAVORS, Qwen3Config, resolve_config
from titan_rl.models.qwen3.model import Qwen3ForCausalLM
from titan_rl.models.qwen3.parallelize import TP_PLAN


def build(flavor: str | Qwen3Config = "debug", options: ModelOptions = ModelOptions(), **overrides) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(resolve_config(flavor, FLAVORS, "qwen3", Qwen3Config, **overrides), options)


SPEC = ArchitectureSpec(
    name="qwen3",
    model_class=Qwen3ForCausalLM,
    build=build,
    flavors=FLAVORS,
    config_from_hf=Qwen3Config.from_hf,
    config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
    vllm_architecture="TitanQwen3ForCausalLM",
    hf_architecture="Qwen3ForCausalLM",
    tp_plan=TP_PLAN,
)
