"""Qwen3.5's ArchitectureSpec (text-only): transformers' and vLLM's Qwen3_5ForCausalLM weights."""

from __future__ import annotations

from titan_rl.models.arch_spec import architecture_spec
from titan_rl.models.common.next import text_key
from titan_rl.models.qwen3_5.config import FLAVORS, Qwen35Config
from titan_rl.models.qwen3_5.model import Qwen35ForCausalLM
from titan_rl.models.qwen3_5.parallelize import TP_PLAN

SPEC = architecture_spec(
    "qwen3_5", Qwen35ForCausalLM, Qwen35Config, FLAVORS,
    vllm_architecture="TitanQwen3_5ForCausalLM", hf_architecture="Qwen3_5ForCausalLM",
    hf_aliases=("Qwen3_5ForConditionalGeneration",),  # its text model
    checkpoint_key=text_key, vllm_class="titan_rl.vllm.hybrid:TitanHybridForCausalLM",
    tp_plan=TP_PLAN, recurrent_state=True)
build = SPEC.build
