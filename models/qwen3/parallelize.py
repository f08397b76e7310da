"""Qwen3's tensor-parallel plan: the dense decoder's (models/common/parallelize.py)."""

from titan_rl.models.common.parallelize import DENSE_TP_PLAN

TP_PLAN = DENSE_TP_PLAN
