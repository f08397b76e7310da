"""Qwen3.5-MoE (text): Qwen3.5's layers (models/common/next.py) with Qwen3-Next's routed MLP
and shared expert (models/common/moe.py), the routes and auxiliary loss of an MoE."""

from __future__ import annotations

from titan_rl.models.common.gdn import HybridCausalLM
from titan_rl.models.common.moe import Routed, SharedExpertMoeBlock
from titan_rl.models.common.next import Qwen35DecoderLayer
from titan_rl.models.ops import Ops
from titan_rl.models.qwen3_5_moe.config import Qwen35MoeConfig


def qwen35_moe_layer(cfg: Qwen35MoeConfig, layer_idx: int, ops: Ops) -> Qwen35DecoderLayer:
    return Qwen35DecoderLayer(cfg, layer_idx, ops, mlp=SharedExpertMoeBlock(cfg, ops))


class Qwen35MoeForCausalLM(Routed, HybridCausalLM):
    make_layer = staticmethod(qwen35_moe_layer)
    norm_offset = True
