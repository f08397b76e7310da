"""Qwen3.5-MoE has no tensor-parallel plan yet, for Qwen3.5's reason (models/qwen3_5/parallelize.py)."""

from titan_rl.models.qwen3_5.parallelize import NO_TP_REASON

__all__ = ["NO_TP_REASON"]
