"""Qwen3-MoE's ArchitectureSpec."""

from __future__ import annotations

from titan_rl.models.arch_spec import architecture_spec
from titan_rl.models.qwen3_moe.config import FLAVORS, Qwen3MoeConfig
from titan_rl.models.qwen3_moe.model import Qwen3MoeForCausalLM
from titan_rl.models.qwen3_moe.parallelize import TP_PLAN

SPEC = architecture_spec("qwen3_moe", Qwen3MoeForCausalLM, Qwen3MoeConfig, FLAVORS,
                         vllm_architecture="TitanQwen3MoeForCausalLM", hf_architecture="Qwen3MoeForCausalLM",
                         tp_plan=TP_PLAN, moe=True)
build = SPEC.build
