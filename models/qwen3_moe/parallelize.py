"""Qwen3-MoE's tensor-parallel plan: qwen3's attention, and every expert's MLP split like
qwen3's dense one (each rank computes its slice of every expert: no expert parallelism).
The router stays replicated: every rank routes the same tokens identically."""

from __future__ import annotations

from titan_rl.models.qwen3.parallelize import ATTENTION, HEAD_COUNTS, shard_attention_heads
from titan_rl.parallel.plan import TPPlan

EXPERTS = {"mlp.experts.*.gate_proj": "colwise", "mlp.experts.*.up_proj": "colwise",
           "mlp.experts.*.down_proj": "rowwise"}

TP_PLAN = TPPlan(layer={**ATTENTION, **EXPERTS}, heads={"self_attn": shard_attention_heads}, divides=HEAD_COUNTS)
