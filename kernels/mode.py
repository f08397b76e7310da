"""The kernel mode: which arithmetic the model's mode-dependent ops use.

"exact": the batch-invariant kernels of this package (trainer == rollout engine, bit for
bit); "stock": plain torch in the trainer and vLLM's built-in model in the engine (to
measure what exactness costs and what it removes). The config key is `model.kernels`,
function parameters are `kernels=`.
"""

from __future__ import annotations

import typing
from typing import Literal

KernelMode = Literal["exact", "stock"]
KERNEL_MODES: tuple[str, ...] = typing.get_args(KernelMode)


def check_kernels(value: object) -> KernelMode:
    """`value` if it is a kernel mode; a ValueError naming it and the allowed ones otherwise."""
    if value not in KERNEL_MODES:
        raise ValueError(f"kernels = {value!r} is not allowed; allowed: {list(KERNEL_MODES)}")
    return typing.cast(KernelMode, value)
