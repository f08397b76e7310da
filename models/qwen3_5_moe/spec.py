"""Qwen3.5-MoE's ArchitectureSpec (text-only): transformers' and vLLM's Qwen3_5MoeForCausalLM weights."""

from __future__ import annotations

from titan_rl.models.arch_spec import architecture_spec
from titan_rl.models.common.next import text_key
from titan_rl.models.qwen3_5_moe.config import FLAVORS, Qwen35MoeConfig
from titan_rl.models.qwen3_5_moe.model import Qwen35MoeForCausalLM
from titan_rl.models.qwen3_5_moe.parallelize import TP_PLAN

SPEC = architecture_spec(
    "qwen3_5_moe", Qwen35MoeForCausalLM, Qwen35MoeConfig, FLAVORS,
    vllm_architecture="TitanQwen3_5MoeForCausalLM", hf_architecture="Qwen3_5MoeForCausalLM",
    hf_aliases=("Qwen3_5MoeForConditionalGeneration",),  # its text model
    checkpoint_key=text_key, vllm_class="titan_rl.vllm.hybrid:TitanHybridForCausalLM",
    tp_plan=TP_PLAN, recurrent_state=True, moe=True)
build = SPEC.build
