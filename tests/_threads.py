"""torch's thread count in tests, set for real.

vLLM's CPU worker replaces `torch.set_num_threads` with a no-op in its process, and the
in-process engines of earlier tests leave it replaced: a "1 vs 2 threads" comparison after
them would compare one thread count with itself and could not fail. `torch._C.set_num_threads`
is the real setter (torch.set_num_threads is that function until vLLM replaces it); every
change is checked.
"""

import contextlib

import torch


def set_threads(n: int) -> None:
    torch._C.set_num_threads(n)
    assert torch.get_num_threads() == n, f"torch's thread count stays {torch.get_num_threads()}, not {n}"


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    set_threads(n)
    try:
        yield n
    finally:
        set_threads(old)
