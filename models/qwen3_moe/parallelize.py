"""Qwen3-MoE's tensor-parallel plan: the dense decoder's attention, and every expert's MLP
split like the dense one (each rank computes its slice of every expert: no expert
parallelism). The router stays replicated: every rank routes the same tokens identically."""

from __future__ import annotations

from titan_rl.models.common.parallelize import ATTENTION, EXPERTS, HEAD_COUNTS, shard_attention_heads
from titan_rl.parallel.plan import TPPlan

TP_PLAN = TPPlan(layer={**ATTENTION, **EXPERTS}, heads={"self_attn": shard_attention_heads}, divides=HEAD_COUNTS)
