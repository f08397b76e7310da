"""GLM-5's ArchitectureSpec: transformers' GlmMoeDsaForCausalLM weights; our wrapper in vLLM
(titan_rl/vllm/dsa.py: the latent KV and the indexer keys in vLLM's paged cache). vLLM's own
GlmMoeDsaForCausalLM is the stock engine where its platform runs it (not its CPU build: its
sparse MLA backends are GPU-only; docs/glm5.md)."""

from __future__ import annotations

from titan_rl.models.arch_spec import ArchitectureSpec
from titan_rl.models.glm_moe_dsa.config import FLAVORS, GlmDsaConfig, resolve_config
from titan_rl.models.glm_moe_dsa.model import GlmMoeDsaForCausalLM
from titan_rl.models.glm_moe_dsa.parallelize import NO_TP_REASON
from titan_rl.models.options import ModelOptions


def build(flavor: str | GlmDsaConfig = "debug_glm5", options: ModelOptions = ModelOptions(),
          **overrides) -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM(resolve_config(flavor, **overrides), options)


SPEC = ArchitectureSpec(
    name="glm_moe_dsa",
    model_class=GlmMoeDsaForCausalLM,
    build=build,
    flavors=FLAVORS,
    config_from_hf=GlmDsaConfig.from_hf,
    config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
    vllm_architecture="TitanGlmMoeDsaForCausalLM",
    hf_architecture="GlmMoeDsaForCausalLM",
    vllm_class="titan_rl.vllm.dsa:TitanDsaForCausalLM",
    tp_plan=None,
    no_tp_reason=NO_TP_REASON,
    moe=True,
    sparse_attention=True,
    # vLLM turns on its own MLA path (and on CPU: no prefix caching, no chunked prefill, blocks
    # of 16) for model_type glm_moe_dsa; our wrapper keeps the latent cache itself
    vllm_overrides={"model_type": "titan_glm_moe_dsa"},
    stock_cpu_refusal=("vLLM's CPU build has no sparse-attention backend for GlmMoeDsaForCausalLM (its platform "
                       "raises \"Sparse Attention is not supported on CPU.\" while building the model)"),
)
