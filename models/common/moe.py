"""The routed MLP (mixture of experts) the Qwen-family MoE models share: its config fields,
the sparse block, the shared-expert block and the model mixin that records routes.

Parameter names equal Hugging Face Qwen3-MoE checkpoints':
  model.layers.N.mlp.gate.weight                        [num_experts, hidden]
  model.layers.N.mlp.experts.M.{gate,up}_proj.weight    [moe_intermediate_size, hidden]
  model.layers.N.mlp.experts.M.down_proj.weight         [hidden, moe_intermediate_size]
(transformers >= 5 fuses the experts into 3D tensors on load; the files keep these names.)
Qwen3-Next's shared expert adds `mlp.shared_expert.*` and `mlp.shared_expert_gate.weight`.

Routing (kernels/moe): fp32 router logits and softmax, top-k with ties to the lowest
expert index, optional renormalisation (norm_topk_prob); experts combined per token in
slot order in fp32.

After each forward: `model.aux_loss` (Switch load-balancing loss over all layers,
transformers' definition; not batch-invariant and not meant to be). Each block's router is
a "routes" choice point (models/common/choice_points.py): `used(model, "routes")` gives per
layer the compact [T, k] expert ids of the last forward, `own(model, "routes")` the router's
own choice (they differ only under replay), and `force(model, "routes", [ids per layer])`
makes the next forwards use exactly those experts (router replay; the weights stay the
current router's probabilities of them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from titan_rl.kernels.moe import compact_routes, load_balancing_loss, moe_experts, router_topk
from titan_rl.models.common.choice_points import ChoicePoint, points
from titan_rl.models.common.config import DenseConfig, dense_fields_from_hf
from titan_rl.models.common.transformer import MLP
from titan_rl.models.layers import Linear, sigmoid_gate
from titan_rl.models.ops import Ops


@dataclass(frozen=True)
class MoeConfig(DenseConfig):
    """The dense fields plus the routed MLP's (config.json's names); every layer is sparse."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001

    def validate(self) -> "MoeConfig":
        super().validate()
        if self.num_experts < 1:
            raise ValueError(f"model.num_experts = {self.num_experts} must be >= 1")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok = {self.num_experts_per_tok} must be in 1..num_experts ({self.num_experts})"
            )
        return self

    def tp_widths(self) -> dict[str, int]:
        return {**super().tp_widths(), "moe_intermediate_size": self.moe_intermediate_size}

    def moe_hf(self) -> dict:
        """The routed MLP's config.json entries (all layers sparse, no router logits output)."""
        return {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "router_aux_loss_coef": self.router_aux_loss_coef, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "output_router_logits": False}


def moe_fields_from_hf(d: dict, norm_topk_prob: bool | None = None) -> dict:
    """The dense and the routed MLP's fields of a config.json whose every layer is sparse."""
    if int(d.get("decoder_sparse_step", 1)) != 1 or list(d.get("mlp_only_layers") or []):
        raise ValueError("config.json has dense layers (decoder_sparse_step != 1 or mlp_only_layers non-empty); "
                         "every layer must be sparse (routes are recorded for every layer)")
    dense = dense_fields_from_hf({**d, "intermediate_size": d.get("intermediate_size", d["moe_intermediate_size"])})
    return {**dense, "num_experts": int(d["num_experts"]), "num_experts_per_tok": int(d["num_experts_per_tok"]),
            "moe_intermediate_size": int(d["moe_intermediate_size"]),
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)) if norm_topk_prob is None else norm_topk_prob,
            "router_aux_loss_coef": float(d.get("router_aux_loss_coef", 0.001))}


class SparseMoeBlock(nn.Module):
    """Router `gate` + `experts` (each the dense MLP at moe_intermediate_size)."""

    def __init__(self, cfg: MoeConfig, ops: Ops):
        super().__init__()
        self.ops, self.k, self.norm_topk_prob = ops, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, ops)
        expert_cfg = replace(cfg, intermediate_size=cfg.moe_intermediate_size)
        self.experts = nn.ModuleList(MLP(expert_cfg, ops, "experts") for _ in range(cfg.num_experts))
        self.routes = ChoicePoint("routes", lambda ids: compact_routes(ids, cfg.num_experts))
        self.last_probs: torch.Tensor | None = None  # for the model's load-balancing loss

    # the trainer's expert parallelism, when on (titan_rl/titan/expert_parallel.py): the same
    # contract as moe_experts, the experts run by the ranks that own them
    expert_parallel = None

    def engine_operands(self, source) -> list:
        """Nothing prepared for the router: router_topk multiplies by its weight, per call."""
        from titan_rl.kernels.linear_forms import untouched

        return untouched(self.gate)

    def forward(self, x):
        weights, ids, probs, own = router_topk(
            x, self.gate.weight, self.k, self.norm_topk_prob,
            route_override=self.routes.override, linear_fn=self.ops.linear, return_probs=True,
        )
        self.last_probs = probs
        self.routes.record(ids, own)
        return (self.expert_parallel or moe_experts)(x, ids, weights, self.experts)


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x))
    (Qwen3-Next, Qwen3.5-MoE; the config has `shared_expert_intermediate_size`)."""

    def __init__(self, cfg, ops: Ops):
        super().__init__(cfg, ops)
        self.shared_expert = MLP(replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size), ops, "experts")
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, ops)

    def forward(self, x):
        shared = self.shared_expert(x)
        routed = super().forward(x)
        return routed + sigmoid_gate(self.ops, self.shared_expert_gate(x)) * shared


class Routed:
    """What a model whose every decoder layer's `mlp` is a SparseMoeBlock adds (a mixin
    before the model class): the auxiliary loss of each forward. The routes are the blocks'
    choice points."""

    aux_loss: torch.Tensor | None = None  # set by every forward (hidden_states)

    def hidden_states(self, *args, **kwargs):
        h = super().hidden_states(*args, **kwargs)
        blocks = [layer.mlp for layer in self.model.layers]
        self.aux_loss = load_balancing_loss(
            [b.last_probs for b in blocks], [p.used for p in points(self, "routes")], self.cfg.num_experts
        )
        for b in blocks:  # do not keep the graph alive through the blocks
            b.last_probs = None
        return h
