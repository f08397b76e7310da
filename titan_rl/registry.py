"""One registration makes an architecture known to both engines.

`register_architecture(spec)` records an ArchitectureSpec (models/arch_spec.py: the model
class, flavors, config converters, TP plan, vLLM wrapper). TorchTitan's side builds a
ModelSpec from it (titan_rl.titan.spec), and vLLM's side registers `spec.vllm_class`
under `spec.vllm_architecture` through the vllm.general_plugins entry point
(titan_rl.vllm.plugin), which runs in every vLLM process. The built-in architectures are
registered here exactly as a user's would be: each model folder's spec.py exports SPEC.
"""

from __future__ import annotations

import torch

from titan_rl.errors import ConfigError
from titan_rl.models.arch_spec import ArchitectureSpec

__all__ = ["ArchitectureSpec", "architecture_for_vllm", "architecture_of", "get_architecture",
           "list_architectures", "register_architecture"]

_REGISTRY: dict[str, ArchitectureSpec] = {}


def register_architecture(spec: ArchitectureSpec) -> ArchitectureSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"architecture {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def get_architecture(name: str) -> ArchitectureSpec:
    _register_builtins()
    if name not in _REGISTRY:
        raise ConfigError(f"model.name = {name!r} is unknown; registered: {sorted(_REGISTRY)}")
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


def architecture_of_folder(path: str) -> ArchitectureSpec:
    """The registered architecture an HF folder's config.json names (its `architectures`
    entry: a spec's HF or vLLM architecture); refused naming the registered ones otherwise."""
    import json
    from pathlib import Path

    from titan_rl.errors import CheckpointError

    _register_builtins()
    cfg_path = Path(path) / "config.json"
    try:
        archs = json.loads(cfg_path.read_text()).get("architectures") or []
    except (OSError, ValueError) as e:
        raise CheckpointError(f"model.name = 'auto': cannot read {cfg_path}: {e}") from None
    for spec in _REGISTRY.values():
        if {spec.hf_architecture, spec.vllm_architecture, *spec.hf_aliases} & set(archs):
            return spec
    known = sorted(a for s in _REGISTRY.values() for a in (s.hf_architecture, *s.hf_aliases))
    raise ConfigError(f"model.name = 'auto': {cfg_path} names architectures = {archs}, which no registered "
                      f"architecture serves; registered: {known}")


def architecture_of(model: torch.nn.Module) -> ArchitectureSpec:
    """The registered architecture of a model (a whole model, as `build` returns it): the
    first class in its MRO that is an architecture's model class (the re-classing wrappers,
    TorchTitan's and FSDP's, come before it; a subclass architecture, like the MoE one
    of qwen3, before its base)."""
    _register_builtins()
    for cls in type(model).__mro__:
        for spec in _REGISTRY.values():
            if spec.model_class is cls:
                return spec
    raise ValueError(f"{type(model).__name__} is not a registered titan_rl architecture")


def _register_builtins() -> None:
    if "qwen3" in _REGISTRY:
        return
    from titan_rl.models.qwen3.spec import SPEC as QWEN3
    from titan_rl.models.qwen3_hybrid.spec import SPEC as QWEN3_HYBRID
    from titan_rl.models.qwen3_moe.spec import SPEC as QWEN3_MOE
    from titan_rl.models.qwen3_next.spec import SPEC as QWEN3_NEXT
    from titan_rl.models.qwen3_5.spec import SPEC as QWEN3_5
    from titan_rl.models.qwen3_5_moe.spec import SPEC as QWEN3_5_MOE
    from titan_rl.models.glm_moe_dsa.spec import SPEC as GLM_MOE_DSA
    from titan_rl.models.llama.spec import SPEC as LLAMA

    for spec in (QWEN3, QWEN3_MOE, QWEN3_HYBRID, QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE, GLM_MOE_DSA, LLAMA):
        register_architecture(spec)
