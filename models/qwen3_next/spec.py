"""Qwen3-Next's ArchitectureSpec: transformers' and vLLM's Qwen3NextForCausalLM weights; our
hybrid wrapper in vLLM (the GDN states in vLLM's state cache), vLLM's own as the stock engine."""

from __future__ import annotations

from titan_rl.models.arch_spec import ArchitectureSpec
from titan_rl.models.options import ModelOptions
from titan_rl.models.qwen3.config import resolve_config
from titan_rl.models.qwen3_next.config import FLAVORS, Qwen3NextConfig, text_key
from titan_rl.models.qwen3_next.model import Qwen3NextForCausalLM
from titan_rl.models.qwen3_next.parallelize import TP_PLAN


def build(flavor: str | Qwen3NextConfig = "debug_qwen3_next", options: ModelOptions = ModelOptions(),
          **overrides) -> Qwen3NextForCausalLM:
    return Qwen3NextForCausalLM(resolve_config(flavor, FLAVORS, "qwen3_next", Qwen3NextConfig, **overrides), options)


SPEC = ArchitectureSpec(
    name="qwen3_next",
    model_class=Qwen3NextForCausalLM,
    build=build,
    flavors=FLAVORS,
    config_from_hf=Qwen3NextConfig.from_hf,
    config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
    vllm_architecture="TitanQwen3NextForCausalLM",
    hf_architecture="Qwen3NextForCausalLM",
    checkpoint_key=text_key,  # published folders carry the MTP head (mtp.*), not trained
    vllm_class="titan_rl.vllm.hybrid:TitanHybridForCausalLM",
    tp_plan=TP_PLAN,
    recurrent_state=True,
    moe=True,
)
