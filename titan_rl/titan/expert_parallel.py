"""Expert parallelism in the trainer (`parallelism.expert_parallel_degree` = D): each of D
ranks owns a run of consecutive routed experts (E / D of them; the first E mod D ranks one
more) and runs them for every rank's tokens, with the bits of one process at every D.

Why the bits hold (docs/torchtitan.md, "Expert parallelism"):
  * dispatch is a permutation: a rank groups its (token, slot) pairs by expert exactly as one
    process does (kernels/moe/torch_impl.by_expert) and sends each group to its owner
    (all_to_all_single with splits). The owner runs an expert on each source rank's group
    ALONE: the rows, order and shape of the one-process call on the leaf that holds those
    tokens. The outputs travel back the same way and the home rank combines a token's k
    slots in slot order, in fp32, as one process does.
  * the experts' weight gradients: under the leaf tree (titan_rl/titan/leaf_reduction.py)
    rank s's i-th leaf is leaf s * G/D + i of the global batch. The owner gives each (expert,
    source) call its own copy of the expert's weights, so each copy's gradient is exactly one
    leaf's; it pushes them on one TreeStack per source and, after the last leaf, adds the
    sources' subtree sums neighbours first: the one-process tree over all G leaves.
  * the gradient of the hidden states: each pair's row comes back to its home rank and
    pair_rows adds a token's slots in slot order, the one-process order.
What it divides: the experts' compute and the reduction of their gradients. What it does
not: every rank keeps every expert's weights and optimizer state (the finished gradients
are all-gathered and every rank takes the same elementwise AdamW step). The experts stay
out of FSDP (fully_shard's ignored_params) as Replicate DTensors on the data-parallel mesh,
so the optimizer, the clipping norm, checkpoints and weight sync treat them like the
FSDP-sharded rest (full_tensor() of a replicated one is its local copy).
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from titan_rl.kernels.matmul.torch_impl import tree_sum
from titan_rl.kernels.moe.torch_impl import combine, expert_order, pair_rows, unsort_pairs
from titan_rl.titan.leaf_reduction import TreeStack

__all__ = ["ExpertParallel", "apply_ep", "expert_parallel_of", "routed_blocks"]


class _Exchange(torch.autograd.Function):
    """all_to_all_single of rows with splits; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.back, ctx.group = (in_splits, out_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, *ctx.back, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def routed_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's routed-expert blocks (those with an `expert_parallel` slot), in order."""
    return [m for m in model.modules() if hasattr(m, "expert_parallel") and isinstance(getattr(m, "experts", None),
                                                                                     nn.ModuleList)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every routed expert's parameters (what expert parallelism keeps out of FSDP)."""
    return [p for b in routed_blocks(model) for p in b.experts.parameters()]


class ExpertParallel:
    """The expert-parallel state of one model on one rank: the group, which experts it owns,
    the per-source weight copies of the current leaf and the per-source gradient trees."""

    def __init__(self, model: nn.Module, group, mesh, *, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None):
        # a process group of its own: FSDP's prefetching all-gathers run asynchronously on the
        # mesh's group (gloo's worker threads) while the forward's exchanges run
        self.group = dist.new_group(dist.get_process_group_ranks(group), use_local_synchronization=True)
        self.degree, self.rank, self.mesh = dist.get_world_size(self.group), dist.get_rank(self.group), mesh
        self.blocks = routed_blocks(model)
        if not self.blocks:
            raise ValueError("parallelism.expert_parallel_degree > 1 needs a mixture-of-experts model")
        n = len(self.blocks[0].experts)
        if n < self.degree:
            raise ValueError(f"parallelism.expert_parallel_degree = {self.degree} must be <= the routed experts ({n})")
        sizes = [n // self.degree + (r < n % self.degree) for r in range(self.degree)]
        self.first = [sum(sizes[:r]) for r in range(self.degree + 1)]  # rank r owns experts first[r]..first[r+1]-1
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self._stacks: list[list[TreeStack]] = []  # [this rank's parameter][source]
        # the tests' control (TITAN_RL_EP_CONTROL=running_sum): each source's leaves summed one
        # after another instead of in the tree: other bits from 3 leaves a source on, which the
        # EP-vs-one-process tests must catch
        self._sum_of_source = RunningSum if os.environ.get("TITAN_RL_EP_CONTROL") == "running_sum" else TreeStack
        self._copies: dict[tuple[int, int], torch.Tensor] = {}
        self.rows_from_others = 0  # (token, slot) rows this rank's experts ran for other ranks
        for b in self.blocks:
            b.expert_parallel = self
            for e in b.experts:
                for lin in e.children():
                    if isinstance(getattr(lin, "weight", None), nn.Parameter) and not isinstance(lin.weight, DTensor):
                        w = lin.weight
                        lin.weight = nn.Parameter(distribute_tensor(w.data, mesh, [Replicate()], src_data_rank=None),
                                                  requires_grad=w.requires_grad)

    def params_of(self, rank: int) -> list[nn.Parameter]:
        """`rank`'s experts' parameters in one order every rank knows (block, expert, name);
        looked up when used: materialising the meta-built model replaces the parameters."""
        lo, hi = self.first[rank], self.first[rank + 1]
        return [p for b in self.blocks for e in b.experts[lo:hi] for p in e.parameters()]

    # -- the forward -----------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
        """kernels.moe.moe_experts's contract (x [T, H], ids [T, k], weights [T, k] -> [T, H]),
        the experts run by their owners."""
        T, k = ids.shape
        D, first, lo, hi = self.degree, self.first, self.first[self.rank], self.first[self.rank + 1]
        order, counts = expert_order(ids, len(experts))
        every = [torch.empty(len(experts), dtype=torch.long) for _ in range(D)]
        dist.all_gather(every, torch.tensor(counts, dtype=torch.long), group=self.group)
        recv = torch.stack(every)[:, lo:hi]  # recv[s, l]: the rows source s sends to this rank's expert lo + l
        in_splits = [sum(counts[first[r]:first[r + 1]]) for r in range(D)]
        out_splits = recv.sum(1).tolist()
        self.rows_from_others += sum(out_splits) - out_splits[self.rank]
        got = _Exchange.apply(pair_rows(x, k).index_select(0, order), out_splits, in_splits, self.group)
        outs = [self._run(experts[lo + l], s, chunk)
                for (s, l), chunk in zip(itertools.product(range(D), range(hi - lo)), got.split(recv.reshape(-1).tolist()))
                if chunk.shape[0]]
        # with no rows received, an empty view keeps both exchanges in the graph: every rank
        # must run their backward collectives
        y = torch.cat(outs) if outs else got[:0]
        back = _Exchange.apply(y, in_splits, out_splits, self.group)
        return combine(unsort_pairs(back, order).view(T, k, -1), weights, x.dtype)

    def _run(self, expert: nn.Module, source: int, rows: torch.Tensor) -> torch.Tensor:
        """The expert on one source's rows; with gradients, on this (source, leaf)'s own copy of
        its weights (cast as FSDP's mixed precision casts the other layers' weights)."""
        grads, params = torch.is_grad_enabled(), {}
        for name, p in expert.named_parameters():
            c = (p.to_local() if isinstance(p, DTensor) else p).detach().to(self.param_dtype or p.dtype)
            if grads:
                key = (id(p), source)
                if key in self._copies:
                    raise RuntimeError("expert parallelism: two forwards with gradients before one backward "
                                       "(each leaf is one forward and one backward)")
                self._copies[key] = c = c.requires_grad_(p.requires_grad)
            params[name] = c
        return torch.func.functional_call(expert, params, (rows,))

    # -- the gradients ---------------------------------------------------------------------
    def leaf_done(self, last: bool) -> None:
        """After a leaf's backward: each copy's gradient (zeros where a source sent no rows)
        onto its source's tree; after the last leaf, the tree over sources, then every rank
        gets every expert's finished gradient."""
        mine = self.params_of(self.rank)
        if not self._stacks:
            self._stacks = [[self._sum_of_source() for _ in range(self.degree)] for _ in mine]
        for p, stacks in zip(mine, self._stacks):
            for s, stack in enumerate(stacks):
                c = self._copies.pop((id(p), s), None)
                g = None if c is None else c.grad
                dtype = self.reduce_dtype or p.dtype
                stack.push(torch.zeros(p.shape, dtype=dtype) if g is None else g.to(dtype))
        self._copies.clear()  # copies of parameters that took no part in the loss
        if not last:
            return
        finished = []
        for p, stacks in zip(mine, self._stacks):  # the sources' subtrees, neighbours first (ranks_tree's order)
            finished.append(tree_sum(torch.stack([stack.pop() for stack in stacks])).to(p.dtype).reshape(-1))
        owned = [self.params_of(r) for r in range(self.degree)]
        width = max(sum(p.numel() for p in ps) for ps in owned)  # all_gather takes equal sizes: pad
        flat = torch.cat(finished)
        flat = torch.cat([flat, flat.new_zeros(width - flat.numel())])
        every = [torch.empty_like(flat) for _ in range(self.degree)]
        dist.all_gather(every, flat, group=self.group)
        for params, buf in zip(owned, every):
            offset = 0
            for p in params:
                g = buf[offset:offset + p.numel()].view(p.shape)
                p.grad = DTensor.from_local(g, self.mesh, [Replicate()], run_check=False) if isinstance(p, DTensor) else g
                offset += p.numel()


class RunningSum:
    """TreeStack's interface, summing in push order: ((a + b) + c) + d. A control only."""

    def __init__(self) -> None:
        self._sum = None

    def push(self, t: torch.Tensor) -> None:
        self._sum = t if self._sum is None else self._sum + t

    def pop(self) -> torch.Tensor:
        out, self._sum = self._sum, None
        return out


def apply_ep(model: nn.Module, group, mesh, **dtypes) -> ExpertParallel:
    """Expert parallelism over `group` (the data-parallel ranks); the experts' weights become
    Replicate DTensors on `mesh` (the data-parallel mesh)."""
    ep = ExpertParallel(model, group, mesh, **dtypes)
    model._titan_rl_expert_parallel = ep
    return ep


def expert_parallel_of(model: nn.Module) -> ExpertParallel | None:
    return getattr(model, "_titan_rl_expert_parallel", None)
