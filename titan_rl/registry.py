"""One registration makes an architecture known to both engines.

`register_architecture(spec)` records the model class, its flavors and config
converters. TorchTitan's side builds a ModelSpec from it (titan_rl.titan.spec), and
vLLM's side registers a wrapper class named `spec.vllm_architecture` through the
vllm.general_plugins entry point (titan_rl.vllm.plugin), which runs in every vLLM
process. The built-in Qwen3 is registered here the same way a user's model would be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class ArchitectureSpec:
    name: str                                   # e.g. "qwen3"
    build: Callable[..., torch.nn.Module]       # build(flavor_or_config, kernels=...) -> model
    flavors: dict[str, Any]                     # flavor name -> model config
    config_from_hf: Callable[[dict], Any]       # HF config.json dict -> model config
    config_to_hf: Callable[[Any, str], dict]    # (model config, architecture name) -> config.json dict
    vllm_architecture: str                      # the `architectures` entry vLLM resolves to our wrapper
    hf_architecture: str                        # the stock HF/vLLM architecture with the same weights
    # "module:Class" of the vLLM wrapper; the default serves any model built from qwen3's
    # pieces. A model with recurrent state (hybrid linear attention) names its own.
    vllm_class: str = "titan_rl.vllm.model:TitanForCausalLM"
    extra: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, ArchitectureSpec] = {}


def register_architecture(spec: ArchitectureSpec) -> ArchitectureSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"architecture {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def get_architecture(name: str) -> ArchitectureSpec:
    _register_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"model.name = {name!r} is unknown; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def list_architectures() -> list[str]:
    _register_builtins()
    return sorted(_REGISTRY)


def architecture_for_vllm(arch: str) -> ArchitectureSpec:
    _register_builtins()
    for spec in _REGISTRY.values():
        if spec.vllm_architecture == arch:
            return spec
    raise ValueError(f"no titan_rl architecture registered for vLLM architecture {arch!r}")


def _register_builtins() -> None:
    """The built-in architectures, registered exactly as a user's would be."""
    if "qwen3" in _REGISTRY:
        return
    from titan_rl.models import qwen3, qwen3_moe

    register_architecture(ArchitectureSpec(
        name="qwen3",
        build=qwen3.build,
        flavors=qwen3.FLAVORS,
        config_from_hf=qwen3.Qwen3Config.from_hf,
        config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
        vllm_architecture="TitanQwen3ForCausalLM",
        hf_architecture="Qwen3ForCausalLM",
    ))
    register_architecture(ArchitectureSpec(
        name="qwen3_moe",
        build=qwen3_moe.build,
        flavors=qwen3_moe.FLAVORS,
        config_from_hf=qwen3_moe.Qwen3MoeConfig.from_hf,
        config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
        vllm_architecture="TitanQwen3MoeForCausalLM",
        hf_architecture="Qwen3MoeForCausalLM",
    ))
    # -- hybrid (GDN linear attention + full attention) --
    from titan_rl.models import qwen3_hybrid

    def parallelize_hybrid(model, *, parallel_dims, **kwargs):  # TorchTitan's parallelize_fn: FSDP2, no TP
        from titan_rl.titan.parallelize import parallelize_qwen3

        qwen3_hybrid.check_tensor_parallel(parallel_dims.tp)
        return parallelize_qwen3(model, parallel_dims=parallel_dims, **kwargs)

    register_architecture(ArchitectureSpec(
        name="qwen3_hybrid",
        build=qwen3_hybrid.build,
        flavors=qwen3_hybrid.FLAVORS,
        config_from_hf=qwen3_hybrid.Qwen3HybridConfig.from_hf,
        config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
        vllm_architecture="TitanQwen3HybridForCausalLM",
        hf_architecture="TitanQwen3HybridForCausalLM",  # no stock implementation with these weights
        vllm_class="titan_rl.vllm.hybrid:TitanHybridForCausalLM",
        extra={"recurrent_state": True, "titan_parallelize_fn": parallelize_hybrid},
    ))
