"""Qwen3 dense: the common dense decoder (models/common/transformer.py) with a per-head
RMSNorm of q and k before RoPE (`Qwen3Config.qk_norm`), untied or tied embeddings."""

from __future__ import annotations

from titan_rl.models.common.transformer import CausalLM


class Qwen3ForCausalLM(CausalLM):
    pass
