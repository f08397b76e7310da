"""vllm.general_plugins entry point: runs in every vLLM process (engine and workers)."""


def register() -> None:
    from vllm import ModelRegistry

    from titan_rl.registry import _REGISTRY, _register_builtins

    _register_builtins()
    for spec in _REGISTRY.values():
        if spec.vllm_architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(spec.vllm_architecture, spec.vllm_class)
