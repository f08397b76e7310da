"""Qwen3.5's ArchitectureSpec (text-only): transformers' and vLLM's Qwen3_5ForCausalLM weights."""

from __future__ import annotations

from titan_rl.models.arch_spec import ArchitectureSpec
from titan_rl.models.options import ModelOptions
from titan_rl.models.qwen3.config import resolve_config
from titan_rl.models.qwen3_5.config import FLAVORS, Qwen35Config
from titan_rl.models.qwen3_5.model import Qwen35ForCausalLM
from titan_rl.models.qwen3_5.parallelize import NO_TP_REASON
from titan_rl.models.qwen3_next.config import text_key


def build(flavor: str | Qwen35Config = "debug_qwen35", options: ModelOptions = ModelOptions(),
          **overrides) -> Qwen35ForCausalLM:
    return Qwen35ForCausalLM(resolve_config(flavor, FLAVORS, "qwen3_5", Qwen35Config, **overrides), options)


SPEC = ArchitectureSpec(
    name="qwen3_5",
    model_class=Qwen35ForCausalLM,
    build=build,
    flavors=FLAVORS,
    config_from_hf=Qwen35Config.from_hf,
    config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
    vllm_architecture="TitanQwen3_5ForCausalLM",
    hf_architecture="Qwen3_5ForCausalLM",
    hf_aliases=("Qwen3_5ForConditionalGeneration",),  # its text model
    checkpoint_key=text_key,
    vllm_class="titan_rl.vllm.hybrid:TitanHybridForCausalLM",
    tp_plan=None,
    no_tp_reason=NO_TP_REASON,
    recurrent_state=True,
)
