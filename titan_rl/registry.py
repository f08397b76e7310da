"""One registration makes an architecture known to both engines.

`register_architecture(spec)` records the model class, its flavors and config
converters. TorchTitan's side builds a ModelSpec from it (titan_rl.titan.spec), and
vLLM's side registers a wrapper class named `spec.vllm_architecture` through the
vllm.general_plugins entry point (titan_rl.vllm.plugin), which runs in every vLLM
process. The built-in Qwen3 is registered here the same way a user's model would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


# The one TP plan TorchTitan's side knows (titan_rl.titan.parallelize): in each decoder
# layer, every models.qwen3.Linear of kind "col" is sharded by output rows, every "row" one
# by input columns, "plain" ones (a router gate) stay replicated.
BY_LINEAR_KIND = "by_linear_kind"


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
    # BY_LINEAR_KIND, or None: no tensor parallelism, for the reason in `no_tp_reason`
    # (TP > 1 is refused with it).
    tp_plan: str | None = BY_LINEAR_KIND
    no_tp_reason: str = ""
    # Requests carry a running state besides the KV cache (linear attention): the engine
    # needs vLLM's state cache, and prefix caching its "align" mode.
    recurrent_state: bool = False
    # A mixture of experts: a router picks experts per token (routes are recorded and can
    # be replayed; the router's auxiliary loss is trained).
    moe: bool = False

    def __post_init__(self) -> None:
        if self.tp_plan not in (BY_LINEAR_KIND, None):
            raise ValueError(f"ArchitectureSpec {self.name!r}: tp_plan = {self.tp_plan!r}; "
                             f"allowed: {BY_LINEAR_KIND!r} or None (with no_tp_reason)")
        if self.tp_plan is None and not self.no_tp_reason:
            raise ValueError(f"ArchitectureSpec {self.name!r}: tp_plan = None needs no_tp_reason "
                             "(the error TP > 1 gets)")


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


def architecture_of(model: torch.nn.Module) -> ArchitectureSpec:
    """The registered architecture of a model (a whole model, as `build` returns it): the
    first class in its MRO defined in the module of an architecture's `build`. The
    re-classing wrappers (TorchTitan's, FSDP's) come before that class in the MRO and
    are defined in no architecture's module."""
    _register_builtins()
    for cls in type(model).__mro__:
        for spec in _REGISTRY.values():
            if spec.build.__module__ == cls.__module__:
                return spec
    raise ValueError(f"{type(model).__name__} is not a registered titan_rl architecture")


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
        moe=True,
    ))
    # -- hybrid (GDN linear attention + full attention) --
    from titan_rl.models import qwen3_hybrid

    register_architecture(ArchitectureSpec(
        name="qwen3_hybrid",
        build=qwen3_hybrid.build,
        flavors=qwen3_hybrid.FLAVORS,
        config_from_hf=qwen3_hybrid.Qwen3HybridConfig.from_hf,
        config_to_hf=lambda cfg, arch: cfg.hf_config(arch),
        vllm_architecture="TitanQwen3HybridForCausalLM",
        hf_architecture="TitanQwen3HybridForCausalLM",  # no stock implementation with these weights
        vllm_class="titan_rl.vllm.hybrid:TitanHybridForCausalLM",
        recurrent_state=True,
    ))
