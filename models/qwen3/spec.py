"""Qwen3's ArchitectureSpec: what TorchTitan and vLLM need to know of it."""

from __future__ import annotations

from titan_rl.models.arch_spec import architecture_spec
from titan_rl.models.qwen3.config import FLAVORS, Qwen3Config
from titan_rl.models.qwen3.model import Qwen3ForCausalLM
from titan_rl.models.qwen3.parallelize import TP_PLAN

SPEC = architecture_spec("qwen3", Qwen3ForCausalLM, Qwen3Config, FLAVORS, vllm_architecture="TitanQwen3ForCausalLM",
                         hf_architecture="Qwen3ForCausalLM", tp_plan=TP_PLAN)
build = SPEC.build
