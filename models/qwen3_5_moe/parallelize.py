"""Qwen3.5-MoE's tensor-parallel plan: Qwen3.5's attention and unfused GDN split (models/qwen3_5/
parallelize.py), every expert and the shared expert split like the dense MLP; the router and
the shared expert's one-output gate stay replicated, as in Qwen3-Next's."""

from __future__ import annotations

from titan_rl.models.common.parallelize import (ATTENTION, EXPERTS, GDN_HEAD_COUNTS, SHARED_EXPERT, UNFUSED_GDN,
                                                UNFUSED_GDN_HEADS, UNFUSED_GDN_WHOLE)
from titan_rl.parallel.plan import TPPlan

TP_PLAN = TPPlan(layer={**ATTENTION, **UNFUSED_GDN, **EXPERTS, **SHARED_EXPERT}, heads=UNFUSED_GDN_HEADS,
                 divides=GDN_HEAD_COUNTS, whole=UNFUSED_GDN_WHOLE)
