"""Choice points: the places where a layer makes a discrete choice that the engine records and
the trainer may replay (titan_rl/choices.py declares the kinds: an MoE router's experts,
"routes"; a sparse-attention indexer's key positions, "indices").

A layer that makes such a choice holds one `ChoicePoint` of its kind and, in its forward,
takes `point.override` (the record forced on it, or None) and reports what it used and what it
would have chosen itself with `point.record(used, own)`. Everything outside the layers goes
through the functions below, by kind, over the model's points in layer order: the engine's
wrappers read `used` after each forward (the capture), the trainer sets `force` before a
replayed forward and reads `own` after it (the disagreement). One mechanism for every kind, so
a new architecture's choice needs a point in its layer and a kind in titan_rl/choices.py,
nothing in the trainer or the engines.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class ChoicePoint:
    """One layer's choice of one kind. `compact` turns a choice into its stored form (the
    smallest integer dtype that holds it), applied to what `record` receives."""

    def __init__(self, kind: str, compact: Callable[[torch.Tensor], torch.Tensor]):
        self.kind, self.compact = kind, compact
        self.override: torch.Tensor | None = None  # [T, ...] for the next forwards over T flat tokens
        self.used: torch.Tensor | None = None  # the last forward's choice, compact
        self.own: torch.Tensor | None = None  # the layer's own choice in it (== used unless replayed)

    def record(self, used: torch.Tensor, own: torch.Tensor) -> None:
        self.used, self.own = self.compact(used), self.compact(own)


def points(model: nn.Module, kind: str) -> list[ChoicePoint]:
    """The model's points of `kind` in layer order (module order: one point per layer and kind)."""
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, ChoicePoint) and v.kind == kind]


def force(model: nn.Module, kind: str, per_layer: list[torch.Tensor] | None) -> None:
    """Force `per_layer` (one [T, ...] record per point of `kind`; a row whose first entry is
    negative keeps the layer's own choice) on the next forwards; None: the layers choose."""
    found = points(model, kind)
    if per_layer is not None and len(per_layer) != len(found):
        raise ValueError(f"{kind} override has {len(per_layer)} layers, the model has {len(found)} {kind} layers")
    for i, p in enumerate(found):
        p.override = None if per_layer is None else per_layer[i]


def used(model: nn.Module, kind: str) -> list[torch.Tensor]:
    """The last forward's choices of `kind` per layer ([] when the model makes none)."""
    return [p.used for p in points(model, kind)]


def own(model: nn.Module, kind: str) -> list[torch.Tensor]:
    """The layers' own choices of `kind` in the last forward, per layer."""
    return [p.own for p in points(model, kind)]
