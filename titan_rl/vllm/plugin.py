"""vllm.general_plugins entry point: runs in every vLLM process (engine and workers)."""


def register() -> None:
    from vllm import ModelRegistry

    from titan_rl.registry import get_architecture, list_architectures

    for spec in map(get_architecture, list_architectures()):
        if spec.vllm_architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(spec.vllm_architecture, spec.vllm_class)
