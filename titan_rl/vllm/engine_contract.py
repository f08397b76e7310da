"""The execution contract of the model a vLLM engine runs, computed where it runs: in this
process for a colocated engine (`engine_contract`), in the engine's own process for a separate
one (`model_contract`, called by titan_rl.vllm.worker_extension). The contract itself, and the
trainer's side, are titan_rl.contract's; this is the engine's side of it, on the vLLM side of
the house (titan_rl.contract imports nothing of titan_rl.vllm)."""

from __future__ import annotations

import torch

from titan_rl import contract


def engine_contract(llm) -> contract.Contract:
    """The contract of an in-process vLLM engine (`model_contract` of the model it runs)."""
    from titan_rl.vllm.engine import engine_model

    return model_contract(engine_model(llm), llm.model_config)


def model_contract(model: torch.nn.Module, model_config) -> contract.Contract:
    """The contract of the model object a vLLM engine runs: our wrapper's (the model
    definition it adopted, the kernel of its attention backend) or vLLM's built-in
    implementation's (stock)."""
    from titan_rl.vllm.model import TitanForCausalLM

    if isinstance(model, TitanForCausalLM):
        return contract.contract_of(model._net, attention=contract.attention_kernel(model))
    return contract.builtin_contract(model_config, model)
