"""MKL's vector math (VML) gets its first call on one thread, before any kernel runs.

ATen computes cos, sin, exp, log, tanh, ... of fp32 and fp64 tensors with MKL's VML in High
Accuracy mode, splitting a tensor of more than 2048 elements across the OpenMP threads. When
the first VML call of a process is such a split call, one thread's share is sometimes computed
in VML's Enhanced Performance mode (about 11 correct bits) instead. Measured on the Intel Xeon
(2026-12-05; `scripts/check_vml_first_call.py` and the same child by hand, with ATen at AVX512
and at AVX2): the first `cos` of a [512, 64] fp32 tensor at 2 threads was wrong in 4 of 240
fresh processes (one thread's half, off by up to 1e-4: exactly the values vmsCos gives in
VML_EP mode, where the script compared them); after one first call on a tensor too small to
split (cos or exp), 0 of 380. It broke the RoPE tables (built once per process by `cos` and
`sin`, then cached) in 3 of 130 runs of tests/test_kernels.py, and a trainer whose table came
out wrong would differ from a separate engine at every step.

`first_call_on_one_thread()` runs when `titan_rl.kernels` is imported: one call on 8
elements (under ATen's grain, so on the calling thread) initialises VML for the process.
"""

from __future__ import annotations

import torch

_DONE = False


def first_call_on_one_thread() -> None:
    global _DONE
    if not _DONE:
        torch.cos(torch.zeros(8))
        _DONE = True
