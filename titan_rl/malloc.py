"""glibc keeps freed memory for reuse instead of giving it back to the kernel: the second
process choice titan_rl makes at import (the first is oneDNN's ISA cap, onednn_cap.py).

Why. A training step allocates and frees the same large buffers every step (logits,
activations and their gradients, and in exact mode the weights prepared for each GEMM: oneDNN's
reorders, the transposed weight of the input gradient, q/k/v and gate/up concatenated). glibc
serves blocks above its mmap threshold (128 KiB, raised on the fly to at most 32 MiB) with fresh
mappings and trims free memory at the top of its heap, so each step faults those pages in
again, and the kernel zeroes each one: about 1.1 us per 4 KiB page on the Intel Xeon here
(2026-12-05, `getrusage` around a 48 MB copy: 18.8 ms fresh against 5.1 ms into a kept buffer).
One fp32 step of the small flavor (8 x 256, one thread, exact and stock side by side in one
process, two processes each way) took 224-246 thousand minor faults in exact mode and 131-178
thousand in stock; with the thresholds below, 0-32 thousand and 0, and the step took 3.87-3.93 s
instead of 4.17-4.34 s (exact) and 3.64-3.71 s instead of 3.76-4.10 s (stock). The price: the
process's peak RSS went from 2.29 to 2.60-2.67 GB there (freed blocks are kept, so blocks of
different sizes do not share pages as often).

What. M_MMAP_THRESHOLD 1 GiB (blocks below it come from the heap and are reused) and
M_TRIM_THRESHOLD 1 GiB (up to that much free memory stays at the top of the heap): a
process keeps about its high-water mark resident, as the caching allocators of GPU
frameworks do. Setting either fixes both in glibc (its automatic adjustment stops), so both
are set; setting only the trim threshold made the same step 10% slower (every block over
128 KiB mapped afresh). Nothing changes a bit of any result: where memory comes from is not
arithmetic. TITAN_RL_MALLOC=system leaves glibc's defaults; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
LIMIT = 1 << 30

_applied: bool | None = None


def apply() -> bool:
    """Set glibc's thresholds once per process; True when they are in force."""
    global _applied
    if _applied is None:
        _applied = False
        if os.environ.get("TITAN_RL_MALLOC", "keep") != "system":
            try:
                libc = ctypes.CDLL(None)
                libc.gnu_get_libc_version  # glibc only  # noqa: B018
                _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, LIMIT)) and bool(libc.mallopt(M_TRIM_THRESHOLD, LIMIT))
            except (OSError, AttributeError):
                pass
    return _applied
