"""GLM-5's ArchitectureSpec: transformers' GlmMoeDsaForCausalLM weights; our wrapper in vLLM
(titan_rl/vllm/dsa.py: the latent KV and the indexer keys in vLLM's paged cache). vLLM's own
GlmMoeDsaForCausalLM is the stock engine where its platform runs it (not its CPU build: its
sparse MLA backends are GPU-only; docs/glm5.md)."""

from __future__ import annotations

from titan_rl.models.arch_spec import architecture_spec
from titan_rl.models.glm_moe_dsa.config import FLAVORS, GlmDsaConfig
from titan_rl.models.glm_moe_dsa.model import GlmMoeDsaForCausalLM
from titan_rl.models.glm_moe_dsa.parallelize import TP_PLAN

SPEC = architecture_spec(
    "glm_moe_dsa", GlmMoeDsaForCausalLM, GlmDsaConfig, FLAVORS,
    vllm_architecture="TitanGlmMoeDsaForCausalLM",
    hf_architecture="GlmMoeDsaForCausalLM",
    vllm_class="titan_rl.vllm.dsa:TitanDsaForCausalLM",
    tp_plan=TP_PLAN,
    moe=True,
    sparse_attention=True,
    # vLLM turns on its own MLA path (and on CPU: no prefix caching, no chunked prefill, blocks
    # of 16) for model_type glm_moe_dsa; our wrapper keeps the latent cache itself
    vllm_overrides={"model_type": "titan_glm_moe_dsa"},
    stock_cpu_refusal=("vLLM's CPU build has no sparse-attention backend for GlmMoeDsaForCausalLM (its platform "
                       "raises \"Sparse Attention is not supported on CPU.\" while building the model)"),
)
build = SPEC.build
