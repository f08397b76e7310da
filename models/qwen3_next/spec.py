"""Qwen3-Next's ArchitectureSpec: transformers' and vLLM's Qwen3NextForCausalLM weights; our
hybrid wrapper in vLLM (the GDN states in vLLM's state cache), vLLM's own as the stock engine."""

from __future__ import annotations

from titan_rl.models.arch_spec import architecture_spec
from titan_rl.models.common.next import text_key
from titan_rl.models.qwen3_next.config import FLAVORS, Qwen3NextConfig
from titan_rl.models.qwen3_next.model import Qwen3NextForCausalLM
from titan_rl.models.qwen3_next.parallelize import TP_PLAN

SPEC = architecture_spec(
    "qwen3_next", Qwen3NextForCausalLM, Qwen3NextConfig, FLAVORS,
    vllm_architecture="TitanQwen3NextForCausalLM", hf_architecture="Qwen3NextForCausalLM",
    checkpoint_key=text_key,  # published folders carry the MTP head (mtp.*), not trained
    vllm_class="titan_rl.vllm.hybrid:TitanHybridForCausalLM", tp_plan=TP_PLAN, recurrent_state=True, moe=True)
build = SPEC.build
