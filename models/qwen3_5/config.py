"""Qwen3.5's text model config (transformers' Qwen3_5TextConfig keys; a Qwen3_5Config's
`text_config` is read the same way), its flavor.

Qwen3-Next's layout (layer_types, gated attention, partial rotary, zero-centred RMSNorm)
with a dense MLP and the GDN projections unfused (models/common/gdn.py, Qwen35GatedDeltaNet). Its RoPE is
transformers' multimodal one (`mrope_section`): for text every token's three position
components are equal, which is plain RoPE on the rotary channels, what we compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_rl.models.common.config import BOS_EOS, DenseConfig, dense_fields_from_hf
from titan_rl.models.common.gdn import GdnConfig
from titan_rl.models.common.next import NextLayout, text_config

TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


@dataclass(frozen=True)
class Qwen35Config(DenseConfig, GdnConfig, NextLayout):
    def validate(self) -> "Qwen35Config":
        super().validate()
        self.validate_gdn()
        self.validate_layout()
        return self

    def tp_widths(self) -> dict[str, int]:
        return {**super().tp_widths(), **self.gdn_tp_widths(fused=False)}

    def hf_config(self, architecture: str = "TitanQwen3_5ForCausalLM", dtype: str = "bfloat16") -> dict:
        d = {**self.hf_fields(architecture, "qwen3_5_text", dtype), **BOS_EOS}
        d.pop("rope_theta")
        d.update(**self.gdn_hf(), **self.layout_hf())
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen35Config":
        d = text_config(d, TEXT_MODEL_TYPES)
        return cls(**dense_fields_from_hf(d), **cls.gdn_from_hf(d, "Qwen3.5"),
                   **cls.layout_from_hf(d, int(d["num_hidden_layers"]))).validate()


FLAVORS: dict[str, Qwen35Config] = {
    # odd sizes (hidden 200, vocab 997, intermediate 328, 3 value heads per key head):
    # GDN, GDN, GDN, gated attention
    "debug_qwen35": Qwen35Config(
        vocab_size=997, hidden_size=200, intermediate_size=328, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rope_theta=10_000.0, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=3),
}
