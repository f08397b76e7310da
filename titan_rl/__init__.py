"""titan_rl: the trainer and the rollout engine compute the same policy, to the bit."""

from titan_rl import malloc as _malloc
from titan_rl import onednn_cap as _onednn_cap

_onednn_cap.apply()  # AMX CPUs: oneDNN's bf16 GEMMs batch-invariant again (before any GEMM)
_malloc.apply()  # glibc reuses freed memory instead of faulting fresh pages in every step

__all__ = ["ArchitectureSpec", "architecture_of", "get_architecture", "list_architectures", "register_architecture"]


def __getattr__(name):
    # Lazy, so `python -m titan_rl.train` can set environment variables torch reads at
    # import (TORCH_CPP_LOG_LEVEL) before anything imports torch.
    if name in __all__:
        from titan_rl import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'titan_rl' has no attribute {name!r}")
