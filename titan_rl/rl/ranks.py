"""This process's place in the run and the few collectives the RL step needs.

`reduce` combines one number over all ranks, or over the data-parallel ranks (one value
per share of the global batch; the TP ranks of a replica hold the same one); `gather_dp`
concatenates the data-parallel ranks' tensors in rank order (the global batch's values,
for statistics that must not depend on the layout); `any` is a decision every rank takes
together (one rank's failure stops all of them).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_degree: int = 1
    dp_group: object = None

    @classmethod
    def of(cls, parallel_dims) -> "Ranks":
        """From TorchTitan's ParallelDims: the data-parallel mesh is its "batch" mesh."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        dp = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None
        if dp is None:
            return cls(rank, world)
        return cls(rank, world, dp.get_local_rank(), dp.size(), dp.get_group())

    def reduce(self, x: float, how: str, over_dp: bool = False) -> float:
        """x combined over all ranks (or the data-parallel ones): "mean", "sum" or "max"."""
        group, n = (self.dp_group, self.dp_degree) if over_dp else (None, self.world)
        if n == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.SUM, group=group)
        return float(t) / n if how == "mean" else float(t)

    def reduce_sums(self, xs: list[float], over_dp: bool = False) -> list[float]:
        """Several sums in one all_reduce (each element as `reduce(x, "sum")` gives it)."""
        group, n = (self.dp_group, self.dp_degree) if over_dp else (None, self.world)
        if n == 1:
            return [float(x) for x in xs]
        t = torch.tensor(xs, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return [float(x) for x in t]

    def broadcast(self, obj, src: int = 0):
        """Rank `src`'s `obj` on every rank (a picklable value)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank."""
        return self.reduce(1.0 if flag else 0.0, "max") > 0

    def gather_dp(self, t: torch.Tensor, same_shape: bool = False) -> torch.Tensor:
        """The data-parallel ranks' `t` (any length along dim 0, the same trailing shape and
        dtype), concatenated in rank order. `same_shape`: the caller knows every rank's `t`
        has one shape, so the lengths need not be exchanged first. Tensors travel as
        tensors (no pickling: all_gather_object cost a few ms per call on the RL step)."""
        if self.dp_degree == 1:
            return t
        group, n, rest = self.dp_group, self.dp_degree, t.shape[1:]
        # as rows of bytes: gloo has no int16 / int32 (MoE routes), and bytes copy any dtype exactly
        raw = t.contiguous().reshape(t.shape[0], math.prod(rest)).view(torch.uint8)
        if same_shape:
            parts = [torch.empty_like(raw) for _ in range(n)]
            dist.all_gather(parts, raw, group=group)
        else:
            length = torch.tensor([raw.shape[0]], dtype=torch.int64)
            lengths = [torch.empty_like(length) for _ in range(n)]
            dist.all_gather(lengths, length, group=group)
            lengths = [int(x) for x in lengths]
            padded = raw.new_zeros((max(lengths), raw.shape[1]))
            padded[:raw.shape[0]] = raw
            parts = [torch.empty_like(padded) for _ in range(n)]
            dist.all_gather(parts, padded, group=group)
            parts = [p[:k] for p, k in zip(parts, lengths)]
        return torch.cat(parts).view(t.dtype).reshape(-1, *rest)

    def digest_dp(self, local: torch.Tensor) -> str:
        """sha256 over the data-parallel ranks' equal-shaped `local` tensors, in rank order."""
        parts = [local]
        if self.dp_degree > 1:
            parts = [torch.empty_like(local) for _ in range(self.dp_degree)]
            dist.all_gather(parts, local, group=self.dp_group)
        return hashlib.sha256(torch.cat(parts).numpy().tobytes()).hexdigest()
