"""States that live in rows of an engine's state cache, as a GDN kernel's initial state.

An engine keeps each sequence's conv and recurrent states in rows of cache tensors between steps.
Passing them as gathered tensors costs three passes over them a step (gather, the op's own copy
out, the store back), each over every sequence's whole state ([Hv, dk, dv] fp32: 1 MiB a
sequence a layer at Qwen3.5-0.8B's widths), and a few tensor ops a layer. Given a `CacheRows`,
the compiled CPU kernels (the recurrence, the causal conv) read each sequence's row and write its
final state back in place; every other form (the torch definitions, Triton, the chunked stock
form) gathers, runs and stores (`through`). Either way the op returns the CacheRows as its final
state, and the cache holds the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class CacheRows:
    """Sequence n starts from cache[rows[n]] where has_context[n], from zeros elsewhere (a row
    whose sequence has no context yet may hold another's leftovers), and its final state goes
    back to cache[rows[n]]. cache [R, ...] (each row contiguous, rows any stride apart);
    rows int64 [N], distinct and >= 0 (an engine's padding rows are not passed this way);
    has_context bool [N]."""

    cache: torch.Tensor
    rows: torch.Tensor
    has_context: torch.Tensor

    def __post_init__(self):
        n = self.rows.shape[0]
        if self.rows.dim() != 1 or self.rows.dtype != torch.int64 or self.has_context.shape != (n,):
            raise ValueError(f"CacheRows: rows int64 [N] and has_context [N], got {self.rows.dtype} "
                             f"{tuple(self.rows.shape)} and {tuple(self.has_context.shape)}")
        if n and (int(self.rows.min()) < 0 or int(self.rows.max()) >= self.cache.shape[0]
                  or self.rows.unique().numel() != n):
            raise ValueError(f"CacheRows: rows must be distinct rows of the cache (0..{self.cache.shape[0] - 1})")

    def gather(self) -> torch.Tensor | None:
        """The initial states [N, ...] as a tensor (None: all zeros, the kernels' own start)."""
        return gather_rows(self.cache, self.rows, self.has_context)

    def put(self, final: torch.Tensor) -> None:
        """Write the final states [N, ...] back to their rows (whole rows, one copy each)."""
        self.cache.index_copy_(0, self.rows, final.to(self.cache.dtype))

    def rows_in(self) -> torch.Tensor:
        """Each sequence's row to start from, -1 for zeros (the compiled step's form)."""
        return torch.where(self.has_context, self.rows, -1).contiguous()

    def through(self, op: Callable, *args, **kw):
        """Run a form that takes its initial state as a tensor, after its positional arguments
        `args`, and returns (output, final state): gather, run, store."""
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args):
            raise ValueError("states in a cache are updated in place: not a differentiable input")
        out, final = op(*args, self.gather(), **kw)
        self.put(final)
        return out, self

    def in_place(self, x: torch.Tensor) -> bool:
        """Whether a compiled CPU kernel can update these rows itself for input x (fp32 states on
        CPU, each row contiguous, x on CPU and computed in fp32)."""
        c = self.cache
        return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and c.dtype == torch.float32 and c.device.type == "cpu" and c[0].is_contiguous())


def gather_rows(cache: torch.Tensor, rows: torch.Tensor, has_context: torch.Tensor) -> torch.Tensor | None:
    """cache[rows] [N, ...], zeros where a sequence has no context; None (the kernels' own zero
    start) where none has. Whole rows by index_select (a row copy each; advanced indexing gathers
    element by element); zeros put in only where some row has no context (a decode step has
    context everywhere)."""
    if not bool(has_context.any()):
        return None
    got = cache.index_select(0, rows)
    if bool(has_context.all()):
        return got
    return torch.where(has_context.view(-1, *[1] * (got.dim() - 1)), got, 0.0)
