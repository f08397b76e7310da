"""Qwen3.5's tensor-parallel plan: the gated attention split like Qwen3-Next's (q_proj's rows
hold each head's query and gate together), the dense MLP, and the GDN layers split by whole
key heads with the unfused projections: in_proj_z / b / a by output rows, in_proj_qkv kept
whole with each rank computing its heads' q, k and v rows (models/common/parallelize.py,
UnfusedGdnHeads)."""

from __future__ import annotations

from titan_rl.models.common.parallelize import (ATTENTION, GDN_HEAD_COUNTS, MLP, UNFUSED_GDN, UNFUSED_GDN_HEADS,
                                                UNFUSED_GDN_WHOLE)
from titan_rl.parallel.plan import TPPlan

TP_PLAN = TPPlan(layer={**ATTENTION, **UNFUSED_GDN, **MLP}, heads=UNFUSED_GDN_HEADS, divides=GDN_HEAD_COUNTS,
                 whole=UNFUSED_GDN_WHOLE)
