"""A tensor-parallel plan as data, and its application, for the trainer and the engine.

Each architecture's `parallelize.py` (models/<name>/parallelize.py) writes its decoder
layer's plan as a `TPPlan`: which Linears are split by output rows ("colwise") or by input
columns ("rowwise"), as patterns relative to the layer (TorchTitan's layer plans look the
same), and which token mixers compute only their rank's heads, with the hook that makes
them. `apply_plan` applies it to every decoder layer; how a weight becomes a rank's share
is the caller's: the trainer makes DTensors (titan_rl/titan/parallelize.py), the engine
keeps plain slices (`apply_tp_local`, titan_rl/vllm/model.py). Both then compute the same
pieces: with tp_leaves = L > 0 the sharded linears issue the same fixed-shape GEMMs as the
model file itself (titan_rl.parallel.tp_linear), so TP = 1, 2, ..., L give the same bits.

The plan must agree with the model's maths: a Linear's `kind` ("col" / "row") is what the
model file computes in one process (Ops.linear_for), so `apply_plan` refuses a plan that
splits a Linear along the other dimension, or leaves a "col"/"row" Linear unsplit. A Linear
here is any module with a `weight`, a `kind` and `ops` (models/layers.py's): this package
sits below the models and imports none of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from titan_rl.layout import check_tp_leaves, check_widths
from titan_rl.parallel.tp_linear import _AllReduceSum, column_parallel_linear, copy_to_tp, row_parallel_linear

logger = logging.getLogger(__name__)

STYLES = {"colwise": ("col", 0), "rowwise": ("row", 1)}  # style -> (Linear kind, weight dim split)


@dataclass(frozen=True)
class TPPlan:
    """One decoder layer's TP plan. `layer`: {pattern: "colwise" | "rowwise"} over the
    layer's module paths (fnmatch; a pattern that matches nothing in a layer, e.g. the
    other mixer of a hybrid, is skipped). `heads`: {pattern: hook(mixer, group)} making a
    token mixer compute its rank's heads. `divides`: the config fields (head counts) the
    TP degree must divide. `whole`: patterns of "col"/"row" Linears that stay whole on
    every rank because their head hook computes the rank's share from the full weight
    (a rank's rows that are not one contiguous range, e.g. Qwen3.5's in_proj_qkv)."""

    layer: dict[str, str]
    heads: dict[str, Callable[[nn.Module, object], None]] = field(default_factory=dict)
    divides: tuple[str, ...] = ()
    whole: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = {p: s for p, s in self.layer.items() if s not in STYLES}
        if bad:
            raise ValueError(f"TPPlan: styles {bad} not allowed; allowed: {list(STYLES)}")

    def resolve(self, layer: nn.Module) -> dict[str, list[str]]:
        """The plan's module paths in one decoder layer: {"colwise": [...], "rowwise": [...],
        "heads": [...]}."""
        out: dict[str, list[str]] = {"colwise": [], "rowwise": [], "heads": []}
        for path, _ in layer.named_modules():
            styles = {s for p, s in self.layer.items() if fnmatchcase(path, p)}
            if len(styles) > 1:
                raise ValueError(f"TPPlan: {path!r} matches patterns of both styles")
            if styles:
                out[styles.pop()].append(path)
            if any(fnmatchcase(path, p) for p in self.heads):
                out["heads"].append(path)
        return out

    def check_degree(self, cfg, tp: int, tp_leaves: int, key: str = "tensor_parallel_degree") -> None:
        """TP degree `tp` against the model config `cfg` (the plan's `divides`) and its leaf
        count (0 allowed: close, not bitwise, to TP = 1): titan_rl.layout's rules."""
        check_widths(key, tp, cfg, self.divides)
        check_tp_leaves(key, tp, tp_leaves, leaves_key="tp_leaves", allow_zero=True)


_MIXED: dict[tuple[type, type], type] = {}


def reclass(mod: nn.Module, mixin: type) -> None:
    """Give `mod` the forward of `mixin` (keeping its parameters and other methods);
    a previous parallel mixin is replaced, not stacked."""
    base = type(mod)
    while base.__dict__.get("_titan_mixed", False):
        base = base.__bases__[1]
    key = (mixin, base)
    if key not in _MIXED:
        _MIXED[key] = type(f"{mixin.__name__}_{base.__name__}", (mixin, base), {"_titan_mixed": True})
    mod.__class__ = _MIXED[key]


def local(w: torch.Tensor) -> torch.Tensor:
    """This rank's share of a weight (a DTensor's local shard, or the plain slice itself)."""
    return w.to_local() if hasattr(w, "to_local") else w


class ColwiseLinear(nn.Module):
    """Re-classing mixin: the weight is this rank's output rows (Shard(0)); the output is
    this rank's columns. The replicated input goes through copy_to_tp (backward all-reduce)."""

    tp_group = None
    tp_leaves: int = 0

    def forward(self, x):
        w = local(self.weight)
        if self.tp_leaves:
            return column_parallel_linear(x, w, self.tp_group, self.tp_leaves)
        return self.ops.linear(copy_to_tp(x, self.tp_group), w)


class RowwiseLinear(nn.Module):
    """Re-classing mixin: the weight is this rank's K-share (Shard(1)), the input this
    rank's K-share; the output replicated (fixed leaf tree when tp_leaves > 0, else
    all-reduce)."""

    tp_group = None
    tp_leaves: int = 0

    def forward(self, x):
        w = local(self.weight)
        if self.tp_leaves:
            return row_parallel_linear(x, w, self.tp_group, self.tp_leaves)
        return _AllReduceSum.apply(self.ops.linear(x, w), self.tp_group)


def _kind(mod: nn.Module) -> str | None:
    """A Linear's kind ("plain", "col", "row"); None for any other module."""
    return getattr(mod, "kind", None) if hasattr(mod, "weight") and hasattr(mod, "ops") else None


def _decoder_layers(model: nn.Module):
    return model.get_submodule("model.layers")


def apply_plan(model: nn.Module, plan: TPPlan, group, shard_weight: Callable[[nn.Module, int], None]) -> None:
    """The plan applied to every decoder layer of `model` (built by its architecture, so its
    `ops` hold the leaf count it computes with); `shard_weight(linear, dim)` replaces the
    Linear's weight by this rank's share along `dim`."""
    tp = dist.get_world_size(group)
    tp_leaves = model.ops.tp_leaves
    plan.check_degree(model.cfg, tp, tp_leaves)
    if not tp_leaves:
        logger.warning("TP=%d with tp_leaves=0: logits are close to, not bitwise equal to, TP=1", tp)
    for layer in _decoder_layers(model):
        paths = plan.resolve(layer)
        planned = set(paths["colwise"]) | set(paths["rowwise"])
        for path, mod in layer.named_modules():
            if _kind(mod) in ("col", "row") and path not in planned and not any(fnmatchcase(path, p)
                                                                              for p in plan.whole):
                raise ValueError(f"TP plan: {path} is a {mod.kind!r} Linear the plan does not split")
        for style, (kind, dim) in STYLES.items():
            mixin = ColwiseLinear if style == "colwise" else RowwiseLinear
            for path in paths[style]:
                lin = layer.get_submodule(path)
                if _kind(lin) != kind:
                    what = f"a {_kind(lin)!r} Linear" if _kind(lin) else "no Linear"
                    raise ValueError(f"TP plan: {path} is split {style} but is {what} (the model computes kind "
                                     f"{kind!r} Linears that way)")
                shard_weight(lin, dim)
                reclass(lin, mixin)
                lin.tp_group, lin.tp_leaves = group, tp_leaves
        for path in paths["heads"]:
            hook = next(h for p, h in plan.heads.items() if fnmatchcase(path, p))
            hook(layer.get_submodule(path), group)


def local_shard(full: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s slice of a full weight split in `tp` equal parts along `dim` (what
    Shard(dim) holds)."""
    return full.chunk(tp, dim)[rank].contiguous()


def apply_tp_local(model: nn.Module, plan: TPPlan, group) -> dict[str, int]:
    """The engine's form of the trainer's TP (the same plan, layers and leaf tree): each
    sharded weight becomes this rank's slice as a plain tensor (the engine never trains).
    Returns {parameter name: the dim it is split on}, so that a loader of full weights can
    take this rank's slice (`local_shard`)."""
    split: dict[str, int] = {}
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    names = {id(m): n for n, m in model.named_modules()}

    def take_slice(lin: nn.Module, dim: int) -> None:
        w = lin.weight
        lin.weight = nn.Parameter(local_shard(w.data, dim, rank, tp), requires_grad=w.requires_grad)
        split[f"{names[id(lin)]}.weight"] = dim

    apply_plan(model, plan, group, take_slice)
    return split
