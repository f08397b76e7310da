"""Llama's ArchitectureSpec: what TorchTitan and vLLM need to know of it (vLLM's own
LlamaForCausalLM is the stock column)."""

from __future__ import annotations

from titan_rl.models.arch_spec import ArchitectureSpec
from titan_rl.models.common.config import resolve_config
from titan_rl.models.common.parallelize import DENSE_TP_PLAN
from titan_rl.models.llama.config import FLAVORS, LlamaConfig
from titan_rl.models.llama.model import LlamaForCausalLM
from titan_rl.models.options import ModelOptions


def build(flavor: str | LlamaConfig = "debug", options: ModelOptions = ModelOptions(), **overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(resolve_config(flavor, FLAVORS, "llama", LlamaConfig, **overrides), options)


SPEC = ArchitectureSpec(
    name="llama",
    model_class=LlamaForCausalLM,
    build=build,
    flavors=FLAVORS,
    config_from_hf=LlamaConfig.from_hf,
    config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
    vllm_architecture="TitanLlamaForCausalLM",
    hf_architecture="LlamaForCausalLM",
    tp_plan=DENSE_TP_PLAN,
)
