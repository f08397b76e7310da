"""Qwen3.5-MoE (text): Qwen3.5's layers (models/qwen3_5/model.py) with Qwen3-Next's routed
MLP and shared expert (models/qwen3_next/model.py), the routes and auxiliary loss of an MoE."""

from __future__ import annotations

from titan_rl.models.ops import Ops
from titan_rl.models.qwen3_hybrid.model import Qwen3HybridForCausalLM
from titan_rl.models.qwen3_moe.model import Routed
from titan_rl.models.qwen3_next.model import SharedExpertMoeBlock
from titan_rl.models.qwen3_5.model import Qwen35DecoderLayer
from titan_rl.models.qwen3_5_moe.config import Qwen35MoeConfig


def qwen35_moe_layer(cfg: Qwen35MoeConfig, layer_idx: int, ops: Ops) -> Qwen35DecoderLayer:
    return Qwen35DecoderLayer(cfg, layer_idx, ops, mlp=SharedExpertMoeBlock(cfg, ops))


class Qwen35MoeForCausalLM(Routed, Qwen3HybridForCausalLM):
    make_layer = staticmethod(qwen35_moe_layer)
    norm_offset = True
