"""Llama's ArchitectureSpec: what TorchTitan and vLLM need to know of it (vLLM's own
LlamaForCausalLM is the stock column). Its TP plan is the dense decoder's."""

from __future__ import annotations

from titan_rl.models.arch_spec import architecture_spec
from titan_rl.models.common.parallelize import DENSE_TP_PLAN
from titan_rl.models.llama.config import FLAVORS, LlamaConfig
from titan_rl.models.llama.model import LlamaForCausalLM

SPEC = architecture_spec("llama", LlamaForCausalLM, LlamaConfig, FLAVORS, vllm_architecture="TitanLlamaForCausalLM",
                         hf_architecture="LlamaForCausalLM", tp_plan=DENSE_TP_PLAN)
build = SPEC.build
