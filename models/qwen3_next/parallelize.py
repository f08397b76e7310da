"""Qwen3-Next's tensor-parallel plan: the dense decoder's attention split (q_proj's rows hold
each head's query and gate together, so a rank's rows are whole heads), the GDN layers split
by whole key heads, every expert and the shared expert split like the dense MLP; the router
and the shared expert's one-output gate stay replicated (models/common/parallelize.py)."""

from __future__ import annotations

from titan_rl.models.common.parallelize import ATTENTION, EXPERTS, GDN, GDN_HEAD_COUNTS, GDN_HEADS, SHARED_EXPERT
from titan_rl.parallel.plan import TPPlan

TP_PLAN = TPPlan(layer={**ATTENTION, **GDN, **EXPERTS, **SHARED_EXPERT}, heads=GDN_HEADS, divides=GDN_HEAD_COUNTS)
