"""titan_rl: the trainer and the rollout engine compute the same policy, to the bit."""

from titan_rl.registry import ArchitectureSpec, get_architecture, list_architectures, register_architecture

__all__ = ["ArchitectureSpec", "get_architecture", "list_architectures", "register_architecture"]
