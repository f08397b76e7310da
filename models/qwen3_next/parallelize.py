"""Qwen3-Next's tensor-parallel plan: qwen3's attention split (q_proj's rows hold each head's
query and gate together, so a rank's rows are whole heads), the hybrid's GDN split by whole
key heads, every expert and the shared expert split like qwen3's MLP; the router and the
shared expert's one-output gate stay replicated."""

from __future__ import annotations

from titan_rl.models.qwen3.parallelize import ATTENTION, HEAD_COUNTS, shard_attention_heads
from titan_rl.models.qwen3_hybrid.parallelize import GDN, shard_gdn_heads
from titan_rl.models.qwen3_moe.parallelize import EXPERTS
from titan_rl.parallel.plan import TPPlan

SHARED_EXPERT = {"mlp.shared_expert.gate_proj": "colwise", "mlp.shared_expert.up_proj": "colwise",
                 "mlp.shared_expert.down_proj": "rowwise"}

TP_PLAN = TPPlan(layer={**ATTENTION, **GDN, **EXPERTS, **SHARED_EXPERT},
                 heads={"self_attn": shard_attention_heads, "linear_attn": shard_gdn_heads},
                 divides=(*HEAD_COUNTS, "linear_num_key_heads"))
