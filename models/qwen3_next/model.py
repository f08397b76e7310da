"""Qwen3-Next, read top to bottom: the GDN layers with Qwen3-Next's grouped projections
(models/common/gdn.py) and, every few layers by `layer_types`, gated attention
(models/common/next.py); zero-centred RMSNorms; every MLP a routed MoE with a shared
expert (models/common/moe.py: `mlp.shared_expert`, `mlp.shared_expert_gate`, added to the
routed experts' output scaled by sigmoid of its one-output gate); the routes and auxiliary
loss of an MoE (Routed)."""

from __future__ import annotations

from titan_rl.models.common.gdn import HybridCausalLM
from titan_rl.models.common.moe import Routed, SharedExpertMoeBlock
from titan_rl.models.common.next import NextDecoderLayer
from titan_rl.models.ops import Ops
from titan_rl.models.qwen3_next.config import Qwen3NextConfig


def next_decoder_layer(cfg: Qwen3NextConfig, layer_idx: int, ops: Ops) -> NextDecoderLayer:
    return NextDecoderLayer(cfg, layer_idx, ops, mlp=SharedExpertMoeBlock(cfg, ops))


class Qwen3NextForCausalLM(Routed, HybridCausalLM):
    make_layer = staticmethod(next_decoder_layer)
    norm_offset = True
