"""Row-wise elementwise ops whose bits do not depend on the buffer they sit in:
the SwiGLU activation and RoPE (reference.py, torch_impl.py)."""

from titan_rl.kernels.elementwise.torch_impl import rope, rope_cos_sin, silu_mul

__all__ = ["rope", "rope_cos_sin", "silu_mul"]
