"""Llama: the common dense decoder (models/common/transformer.py) as it is, with no q/k norm
(`LlamaConfig.qk_norm = False`): embeddings (tied or not), pre-norm layers of GQA attention with
RoPE and a SwiGLU MLP, a final RMSNorm, the fp32 LM head."""

from __future__ import annotations

from titan_rl.models.common.transformer import CausalLM


class LlamaForCausalLM(CausalLM):
    pass
