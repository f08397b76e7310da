"""titan_rl: the trainer and the rollout engine compute the same policy, to the bit."""

__all__ = ["ArchitectureSpec", "architecture_of", "get_architecture", "list_architectures", "register_architecture"]


def __getattr__(name):
    # Lazy, so `python -m titan_rl.train` can set environment variables torch reads at
    # import (TORCH_CPP_LOG_LEVEL) before anything imports torch.
    if name in __all__:
        from titan_rl import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'titan_rl' has no attribute {name!r}")
