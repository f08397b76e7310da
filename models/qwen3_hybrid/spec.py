"""The GDN hybrid's ArchitectureSpec: its own vLLM wrapper (the GDN layers' states live in
vLLM's state cache) and no stock implementation with these weights."""

from __future__ import annotations

from titan_rl.models.arch_spec import architecture_spec
from titan_rl.models.qwen3_hybrid.config import FLAVORS, Qwen3HybridConfig
from titan_rl.models.qwen3_hybrid.model import Qwen3HybridForCausalLM
from titan_rl.models.qwen3_hybrid.parallelize import TP_PLAN

SPEC = architecture_spec(
    "qwen3_hybrid", Qwen3HybridForCausalLM, Qwen3HybridConfig, FLAVORS,
    vllm_architecture="TitanQwen3HybridForCausalLM",
    hf_architecture="TitanQwen3HybridForCausalLM",  # no stock implementation with these weights
    vllm_class="titan_rl.vllm.hybrid:TitanHybridForCausalLM", tp_plan=TP_PLAN, recurrent_state=True)
build = SPEC.build
