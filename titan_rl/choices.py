"""Recorded choices: what the engine chose while sampling that the trainer's forward either
takes from its record (replay) or makes itself and is measured against (disagreement).

Three kinds, each declared once below:

  kept_sets  the sampler's top-k/top-p kept set per sampled token (sampling.mask_mode =
             "replay"): replayed in the sampled token's log-prob, not in the model
  routes     the experts an MoE router sent each token to (always recorded; replayed with
             rollout.router_replay = "replay"); trained with the router's load-balancing loss
  indices    the key positions each sparse-attention indexer selected (GLM-5; always recorded,
             replayed with rollout.index_selection = "replay"); trained with the indexer loss

A kind names its engine capture (titan_rl.vllm), when a run records and replays it, whether
the model's layers make it (then they hold choice points of the kind's name,
models/common/choice_points.py, through which both engines read it and the trainer replays
it), its disagreement metric, its bytes per sampled token and its auxiliary loss. An architecture lists its kinds in its spec
(`ArchitectureSpec.choice_kinds`); `RunChoices` is one run's set, which the trainer asks
for captures, metrics and auxiliary losses, and `replay` forces a batch's records on the model.
"""

from __future__ import annotations

import functools
import importlib
import operator
from dataclasses import dataclass
from typing import Callable

import torch

from titan_rl.metrics import expert_disagreement, index_disagreement
from titan_rl.models.common import choice_points


@dataclass(frozen=True)
class ChoiceKind:
    name: str  # the capture's and Rollout.from_vllm's keyword; the ScoredBatch field is `field`
    field: str
    capture: str  # "module:function": with function(llm) as record: llm.generate(...)
    recorded: Callable  # cfg -> recorded in this run (the architecture listing the kind aside)
    replayed: Callable  # cfg -> the trainer's forward takes the engine's record
    bytes_metric: str  # the step line's entry of the record's size
    bytes_per_token: Callable  # (rollout, cfg) -> that size per sampled token
    in_model: bool = False  # made by the model's layers, at choice points named `name`
    disagreement: str = ""  # the metric of the engine's record against the trainer's own choices
    measure: Callable | None = None  # titan_rl.metrics' function of it
    aux_loss: str = ""  # the model's attribute (and the metric): the last forward's auxiliary loss
    aux_coef: Callable | None = None  # (model, cfg) -> its coefficient in the training loss

    def open_capture(self, llm):
        module, function = self.capture.split(":")
        return getattr(importlib.import_module(module), function)(llm)


KINDS = {k.name: k for k in (
    ChoiceKind("kept_sets", "kept", "titan_rl.vllm.sampling:capture_kept_sets",
               recorded=lambda cfg: cfg.sampling.mask_mode == "replay",
               replayed=lambda cfg: cfg.sampling.mask_mode == "replay",
               bytes_metric="kept_set_bytes_per_token",
               bytes_per_token=lambda r, cfg: r.kept_bytes / max(r.num_tokens, 1)),
    ChoiceKind("routes", "routes", "titan_rl.vllm.routes:capture_routes",
               # recorded even without replay: the disagreement is measured
               recorded=lambda cfg: True, replayed=lambda cfg: cfg.rollout.router_replay == "replay",
               bytes_metric="route_bytes_per_token", bytes_per_token=lambda r, cfg: r.route_bytes_per_token,
               in_model=True, disagreement="expert_disagreement",
               measure=expert_disagreement, aux_loss="aux_loss",
               aux_coef=lambda model, cfg: model.cfg.router_aux_loss_coef),
    ChoiceKind("indices", "indices", "titan_rl.vllm.indices:capture_indices",
               # recorded when pinned as well: the disagreement is measured
               recorded=lambda cfg: True, replayed=lambda cfg: cfg.rollout.index_selection == "replay",
               bytes_metric="index_bytes_per_token",
               # what the trainer is sent: the record under replay, nothing when pinned
               bytes_per_token=lambda r, cfg: r.index_bytes_per_token if cfg.rollout.index_selection == "replay"
               else 0,
               in_model=True, disagreement="index_disagreement",
               measure=index_disagreement, aux_loss="indexer_loss",  # only while the indexers train
               aux_coef=lambda model, cfg: cfg.model.indexer_loss_coef),
)}


def replay(cfg, model, b, rows: range) -> None:
    """The engine's records of `rows` in the ScoredBatch `b` forced on the model's next
    forwards, for each kind recorded there that the run replays."""
    for k in KINDS.values():
        if k.in_model and getattr(b, k.field) is not None and k.replayed(cfg):
            choice_points.force(model, k.name, b.flat(k.field, rows))


class RunChoices:
    """The choice kinds one run records: the sampler's kept sets and its architecture's kinds."""

    def __init__(self, cfg, spec):
        self.cfg = cfg
        self.kinds = [k for k in (KINDS[n] for n in ("kept_sets", *spec.choice_kinds)) if k.recorded(cfg)]
        self.in_model = [k for k in self.kinds if k.in_model]

    @property
    def capture(self) -> list[str]:
        return [k.name for k in self.kinds]

    def bytes_metrics(self, rollout) -> dict:
        return {k.bytes_metric: k.bytes_per_token(rollout, self.cfg) for k in self.kinds}

    def release(self, model) -> None:
        for k in self.in_model:
            choice_points.force(model, k.name, None)

    def own(self, model) -> dict[str, torch.Tensor]:
        """The model's own choices in its last forward, [T, layers, ...] per kind."""
        return {k.field: torch.stack(choice_points.own(model, k.name), 1) for k in self.in_model}

    def disagreements(self, plan, b, own: list[dict]) -> dict:
        """Each recorded (position, layer) choice of the engine against the trainer's own,
        `own` being the pieces' own() in row order."""
        out = {}
        for k in self.in_model:
            record = getattr(b, k.field)
            valid = record[:, :, 0, 0] >= 0
            mine = torch.cat([o[k.field] for o in own]).view(*record.shape)
            out[k.disagreement] = plan.disagreement(k.measure, record[valid], mine[valid])
        return out

    def aux_losses(self, model) -> dict[str, torch.Tensor]:
        """The auxiliary losses of the model's last forward (those it computed)."""
        return {k.aux_loss: value for k, value in self._aux(model)}

    def aux_loss(self, model):
        """Their sum in the training loss, each times its coefficient; 0.0 when none."""
        terms = [k.aux_coef(model, self.cfg) * value for k, value in self._aux(model)]
        return functools.reduce(operator.add, terms) if terms else 0.0

    def _aux(self, model) -> list[tuple[ChoiceKind, torch.Tensor]]:
        found = [(k, getattr(model, k.aux_loss, None)) for k in self.in_model]
        return [(k, value) for k, value in found if value is not None]
