"""Qwen3's tensor-parallel plan: the dense decoder's (models/common/parallelize.py)."""

from titan_rl.models.common.parallelize import ATTENTION, DENSE_TP_PLAN, HEAD_COUNTS, MLP, shard_attention_heads

__all__ = ["ATTENTION", "HEAD_COUNTS", "MLP", "TP_PLAN", "shard_attention_heads"]

TP_PLAN = DENSE_TP_PLAN
