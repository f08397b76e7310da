"""Qwen3.5-MoE has no tensor-parallel plan yet, for Qwen3.5's reason: the unfused GDN
projections (models/common/parallelize.py, UNFUSED_GDN_NO_TP_REASON)."""

from titan_rl.models.common.parallelize import UNFUSED_GDN_NO_TP_REASON as NO_TP_REASON

__all__ = ["NO_TP_REASON"]
