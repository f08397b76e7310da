"""Qwen3.5 has no tensor-parallel plan yet: its unfused GDN projection in_proj_qkv holds q,
then k, then v of all heads, so a rank's heads are three separate row ranges of it, not one
shard (Qwen3-Next's grouped in_proj_qkvz is). FSDP works; TP > 1 is refused with NO_TP_REASON."""

from titan_rl.models.common.parallelize import UNFUSED_GDN_NO_TP_REASON as NO_TP_REASON

__all__ = ["NO_TP_REASON"]
