"""Qwen3-Next, read top to bottom: the hybrid's GDN layers (models/qwen3_hybrid/model.py,
Qwen3-Next's own grouped projections) and, every few layers by `layer_types`, gated
attention; zero-centred RMSNorms; every MLP a routed MoE with a shared expert.

Gated attention (`model.layers.N.self_attn.*`): q_proj gives each head its query and its
output gate side by side ([T, H, 2*D]); q_norm / k_norm are zero-centred; RoPE turns the
first `rotary_dim` channels of each head; the attention output times sigmoid(gate) goes
to o_proj. The shared expert (`mlp.shared_expert`, `mlp.shared_expert_gate`) is added to
the routed experts' output, scaled by sigmoid of its one-output gate. Every transcendental
of an input whose size depends on the batch goes through `ops.elementwise` (lane_stable in
exact mode) and is rounded to the model's dtype as transformers rounds it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from titan_rl.models.layers import AttentionFn, HeadRMSNorm, Linear
from titan_rl.models.ops import Ops
from titan_rl.models.qwen3.model import MLP, Attention
from titan_rl.models.qwen3_hybrid.model import HybridDecoderLayer, Qwen3HybridForCausalLM
from titan_rl.models.qwen3_moe.model import Routed, SparseMoeBlock
from titan_rl.models.qwen3_next.config import Qwen3NextConfig


def sigmoid_gate(ops: Ops, gate: torch.Tensor) -> torch.Tensor:
    """sigmoid(gate) in the gate's dtype (computed in fp32, rounded once, as torch does)."""
    return ops.elementwise(torch.sigmoid, gate.float()).to(gate.dtype)


class GatedAttention(Attention):
    def __init__(self, cfg, layer_idx: int, ops: Ops):
        nn.Module.__init__(self)
        h, hkv, d, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.layer_idx, self.h, self.hkv, self.d, self.theta = layer_idx, h, hkv, d, cfg.rope_theta
        self.rotary_dim, self.ops = cfg.rotary_dim, ops
        self.q_proj = Linear(e, h * d * 2, ops, "col", "attention")  # per head: query, then output gate
        self.k_proj = Linear(e, hkv * d, ops, "col", "attention")
        self.v_proj = Linear(e, hkv * d, ops, "col", "attention")
        self.o_proj = Linear(h * d, e, ops, "row", "attention")
        self.q_norm = HeadRMSNorm(d, cfg.rms_norm_eps, ops, offset=True)
        self.k_norm = HeadRMSNorm(d, cfg.rms_norm_eps, ops, offset=True)
        self.packed_qkv = None

    def forward(self, x, positions, attn: AttentionFn):
        T, d = x.shape[0], self.d
        qg, k, v = self.ops.same_input(x, [self.q_proj, self.k_proj, self.v_proj], self.packed_qkv)
        qg = qg.view(T, self.h, 2 * d)
        q, gate = qg[..., :d].contiguous(), qg[..., d:]
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, self.hkv, d))
        v = v.view(T, self.hkv, d)
        q = self.ops.partial_rope(q, positions, self.theta, self.rotary_dim)
        k = self.ops.partial_rope(k, positions, self.theta, self.rotary_dim)
        o = attn(self.layer_idx, q, k, v).reshape(T, self.h * d)
        return self.o_proj(o * sigmoid_gate(self.ops, gate.reshape(T, self.h * d)))


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg, ops: Ops):
        super().__init__(cfg, ops)
        self.shared_expert = MLP(replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size), ops, "experts")
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, ops)

    def forward(self, x):
        shared = self.shared_expert(x)
        routed = super().forward(x)
        return routed + sigmoid_gate(self.ops, self.shared_expert_gate(x)) * shared


class NextDecoderLayer(HybridDecoderLayer):
    attention_cls = GatedAttention
    norm_offset = True


def next_decoder_layer(cfg: Qwen3NextConfig, layer_idx: int, ops: Ops) -> NextDecoderLayer:
    return NextDecoderLayer(cfg, layer_idx, ops, mlp=SharedExpertMoeBlock(cfg, ops))


class Qwen3NextForCausalLM(Routed, Qwen3HybridForCausalLM):
    """The hybrid's LM (state handling, the trainer's forward) over Qwen3-Next's layers,
    with the routes and auxiliary loss of an MoE (qwen3_moe's Routed)."""

    make_layer = staticmethod(next_decoder_layer)
    norm_offset = True
