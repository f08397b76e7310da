"""Qwen3.5 has no tensor-parallel plan yet: in_proj_qkv holds q, then k, then v of all heads,
so a rank's heads are three separate row ranges of it, not one shard (Qwen3-Next's grouped
in_proj_qkvz is). FSDP works; TP > 1 is refused with NO_TP_REASON."""

NO_TP_REASON = ("in_proj_qkv holds q, k and v of all heads one after the other, so a rank's heads are three "
                "separate row ranges; splitting it is not implemented")
