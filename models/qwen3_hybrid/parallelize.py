"""The hybrid's tensor-parallel plan: the dense decoder's attention and MLP, and the GDN
layers split by whole key heads (models/common/parallelize.py says why that is exact)."""

from __future__ import annotations

from titan_rl.models.common.parallelize import ATTENTION, GDN, GDN_HEAD_COUNTS, GDN_HEADS, MLP
from titan_rl.parallel.plan import TPPlan

TP_PLAN = TPPlan(layer={**ATTENTION, **GDN, **MLP}, heads=GDN_HEADS, divides=GDN_HEAD_COUNTS)
