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

What, at import:
- M_MMAP_THRESHOLD, M_TRIM_THRESHOLD and M_TOP_PAD at the largest value mallopt takes (an
  int: 2 GiB - 1): blocks below 2 GiB come from the heap; free memory at the top of the heap
  is given back only beyond 2 GiB, and then 2 GiB of it is kept. Setting either threshold
  fixes both in glibc (its automatic adjustment stops), so both are set; setting only the trim
  threshold made the same step 10% slower (every block over 128 KiB mapped afresh).
- GLIBC_TUNABLES gets `TUNABLES` (the tcache off; trim and mmap thresholds of 1 TiB, sizes
  mallopt's int cannot say) for every process started from this one (engine workers,
  torchrun ranks, test subprocesses). glibc reads them only when a process starts, so a main
  program (`python -m titan_rl.train`, parity, eval, the benchmarks) starts itself again with
  them (`restart_with_tunables`, before its work begins: one exec), and a process started
  with them skips the mallopt calls (which would lower its thresholds). A value a user already
  gave one of those names is kept.
A process then keeps about its high-water mark resident, as the caching allocators of GPU
frameworks do.

Why the tcache (the mechanism as glibc's source reads; the cure is what was measured). torch
allocates a large buffer with posix_memalign, and each tensor's small bookkeeping blocks land
between consecutive large buffers; freed, those small blocks sit in glibc's per-thread cache,
which never merges them with their neighbours, so a freed large buffer stays an island of
exactly its own size, too small for the next identical request (memalign asks for the size plus
alignment slack), and that request is served from fresh memory at the top of the heap: faulted
in. Three 448 MB buffers allocated and freed in a loop faulted 344 thousand pages every round
with the cache on, 0 after the first with it off.
Why the thresholds: at 1 GiB (until 2026-12-06) a step that frees several vocabulary-sized
buffers at once (SmolLM2's fp32 logits, their log-softmax and gradients: 400 MB each at 8 x 256
tokens) left more than 1 GiB free at the top of the heap, glibc gave it back, and the next step
faulted it in again; 2 GiB is still too little for Qwen3-0.6B's widths in fp32 (1.2 GB each).
Measured (Intel Xeon, one thread, 2026-12-06; exact and compiled stock trainers in one process):
- SmolLM2 fp32 8 x 256: at 1 GiB with the cache, 0-393 thousand faults a step, irregularly, in
  every column (the exact step's log-softmax 209 ms against stock's 120 ms on the same shapes);
  at 2 GiB without the cache none from the third step on, peak RSS 7.4 -> 7.1 GB.
- Qwen3-0.6B's widths, fp32, 8 x 256: at 2 GiB without the cache the exact step faulted 690
  thousand pages (2.8 GB) every step, its fills 5.0 s and log-softmax backward 4.6 s; with the
  1 TiB tunables none after the first step, and the step 59.9-62.3 -> 51.5 s (compiled stock
  50.5 s), peak RSS 19.0 GB either way.
- Rollouts ran alike with the cache off and on (small flavor, bf16, own samplers: 289 and 293
  exact tokens/s against 280 and 306).
Nothing changes a bit of any result: where memory comes from is not arithmetic.
TITAN_RL_MALLOC=system leaves glibc's defaults and the environment alone; other C libraries are
left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters (malloc.h)
LIMIT = (1 << 31) - 1  # mallopt takes an int
# What a process started with GLIBC_TUNABLES gets instead (sizes there are size_t): no cache, no
# trimming and no mmap below 1 TiB, i.e. the heap keeps its high-water mark whatever the step.
TUNABLES = {"glibc.malloc.tcache_count": "0", "glibc.malloc.trim_threshold": str(1 << 40),
            "glibc.malloc.mmap_threshold": str(1 << 40)}

_applied: bool | None = None


def _tunables() -> dict[str, str]:
    pairs = (t.partition("=") for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t)
    return {k: v for k, _, v in pairs}


# what glibc read when this process started (before apply() exports the tunables): ours, or a
# user's value for each of their names (kept)
_AT_START = _tunables()
STARTED_WITH_TUNABLES = all(k in _AT_START for k in TUNABLES)


def apply() -> bool:
    """Keep freed memory in this process (the tunables it started with, else mallopt's
    thresholds) and export the tunables to the processes started from it; True when this
    process keeps it."""
    global _applied
    if _applied is None:
        _applied = False
        if os.environ.get("TITAN_RL_MALLOC", "keep") != "system":
            try:
                libc = ctypes.CDLL(None)
                libc.gnu_get_libc_version  # glibc only  # noqa: B018
                # mallopt would lower the started-with thresholds to its int limit
                _applied = STARTED_WITH_TUNABLES or all(
                    bool(libc.mallopt(p, LIMIT)) for p in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD))
            except (OSError, AttributeError):
                pass
            if _applied:
                have = _tunables()
                missing = [f"{k}={v}" for k, v in TUNABLES.items() if k not in have]
                if missing:
                    os.environ["GLIBC_TUNABLES"] = ":".join([*(f"{k}={v}" for k, v in have.items()), *missing])
    return _applied


def restart_with_tunables() -> None:
    """For a main program, before its work: where titan_rl keeps freed memory but this process
    started without the tunables, start it again (the same interpreter, options and arguments,
    the same PID) with them. Does nothing otherwise (a value the user set is kept), so it runs
    at most once."""
    if apply() and not STARTED_WITH_TUNABLES:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, sys.orig_argv)


def run_main(main) -> None:
    """The tail of every main program (titan_rl.train / parity / eval, the benchmarks): start
    again with the tunables where titan_rl keeps freed memory (glibc reads them only at start:
    restart_with_tunables), then exit with main()'s code."""
    restart_with_tunables()
    sys.exit(main())
