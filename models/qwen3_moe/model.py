"""Qwen3-MoE decoder: qwen3's (models/qwen3/model.py) with the dense MLP replaced by a routed one.

Everything but the MLP (attention, RoPE, q/k norms, RMSNorm, Linear and its kinds, the
LM head, `hidden_states`/`logits`/`forward`) is qwen3's, and the kernel modes are
models/ops.py's `Ops`: imported, not copied, so both engines drive this model exactly
like the dense one.

Parameter names equal Hugging Face Qwen3-MoE checkpoints':
  model.layers.N.mlp.gate.weight                        [num_experts, hidden]
  model.layers.N.mlp.experts.M.{gate,up}_proj.weight    [moe_intermediate_size, hidden]
  model.layers.N.mlp.experts.M.down_proj.weight         [hidden, moe_intermediate_size]
(transformers >= 5 fuses the experts into 3D tensors on load; the files keep these names.)

Routing (kernels/moe): fp32 router logits and softmax, top-k with ties to the lowest
expert index, optional renormalisation (norm_topk_prob); experts combined per token in
slot order in fp32. Every layer is sparse (decoder_sparse_step = 1, no mlp_only_layers,
no shared expert: Qwen3-MoE's published models).

After each forward: `model.aux_loss` (Switch load-balancing loss over all layers,
transformers' definition; not batch-invariant and not meant to be) and
`model.last_routes` (per layer, the compact [T, k] expert ids used) and
`model.last_own_routes` (the router's own choice; differs from last_routes only under
replay). Router replay: `model.set_route_override([ids per layer] or None)` makes the
next forwards use exactly those experts (the weights stay the current router's
probabilities of them).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from titan_rl.kernels.moe import compact_routes, load_balancing_loss, moe_experts, router_topk
from titan_rl.models.layers import Linear
from titan_rl.models.ops import Ops
from titan_rl.models.qwen3.model import MLP, DecoderLayer, Qwen3ForCausalLM
from titan_rl.models.qwen3_moe.config import Qwen3MoeConfig


class SparseMoeBlock(nn.Module):
    """Router `gate` + `experts` (each qwen3.MLP at moe_intermediate_size)."""

    def __init__(self, cfg: Qwen3MoeConfig, ops: Ops):
        super().__init__()
        self.ops, self.k, self.norm_topk_prob = ops, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, ops)
        expert_cfg = replace(cfg, intermediate_size=cfg.moe_intermediate_size)
        self.experts = nn.ModuleList(MLP(expert_cfg, ops, "experts") for _ in range(cfg.num_experts))
        self.route_override: torch.Tensor | None = None
        self.last_probs: torch.Tensor | None = None
        self.last_ids: torch.Tensor | None = None       # the experts used
        self.last_own_ids: torch.Tensor | None = None   # the router's own choice (== used unless replayed)

    def engine_operands(self, source) -> tuple[dict, list[nn.Module]]:
        """Nothing prepared for the router: router_topk multiplies by its weight, per call."""
        return {}, [self.gate]

    def forward(self, x):
        weights, ids, probs, own = router_topk(
            x, self.gate.weight, self.k, self.norm_topk_prob,
            route_override=self.route_override, linear_fn=self.ops.linear, return_probs=True,
        )
        self.last_probs, self.last_ids, self.last_own_ids = probs, ids, own
        return moe_experts(x, ids, weights, self.experts)


def moe_decoder_layer(cfg: Qwen3MoeConfig, layer_idx: int, ops: Ops) -> DecoderLayer:
    """qwen3's decoder layer with the routed block in the MLP's place."""
    return DecoderLayer(cfg, layer_idx, ops, mlp=SparseMoeBlock(cfg, ops))


class Routed:
    """What a model whose every decoder layer's `mlp` is a SparseMoeBlock adds (a mixin
    before the model class): the routes and the auxiliary loss of each forward, and router
    replay."""

    # set by every forward (hidden_states)
    aux_loss: torch.Tensor | None = None
    last_routes: list[torch.Tensor] | None = None
    last_own_routes: list[torch.Tensor] | None = None

    def set_route_override(self, routes: list[torch.Tensor] | None) -> None:
        """Per layer [T, k] expert ids for the next forwards over T flat tokens (None:
        route normally; a row whose first id is negative routes normally too)."""
        layers = self.model.layers
        if routes is not None and len(routes) != len(layers):
            raise ValueError(f"route override has {len(routes)} layers, the model {len(layers)}")
        for i, layer in enumerate(layers):
            layer.mlp.route_override = None if routes is None else routes[i]

    def hidden_states(self, *args, **kwargs):
        h = super().hidden_states(*args, **kwargs)
        blocks = [layer.mlp for layer in self.model.layers]
        self.last_routes = [compact_routes(b.last_ids, self.cfg.num_experts) for b in blocks]
        self.last_own_routes = [compact_routes(b.last_own_ids, self.cfg.num_experts) for b in blocks]
        self.aux_loss = load_balancing_loss(
            [b.last_probs for b in blocks], [b.last_ids for b in blocks], self.cfg.num_experts
        )
        for b in blocks:  # do not keep the graph alive through the blocks
            b.last_probs = b.last_ids = b.last_own_ids = None
        return h


class Qwen3MoeForCausalLM(Routed, Qwen3ForCausalLM):
    """qwen3.Qwen3ForCausalLM with MoE layers; __init__/hidden_states/logits/forward/
    init_weights are qwen3's (same signatures, same kernels)."""

    make_layer = staticmethod(moe_decoder_layer)
