"""Qwen3.5's text model config (transformers' Qwen3_5TextConfig keys; a Qwen3_5Config's
`text_config` is read the same way), its flavor.

Qwen3-Next's layout (layer_types, gated attention, partial rotary, zero-centred RMSNorm)
with a dense MLP and the GDN projections unfused (models/qwen3_5/model.py). Its RoPE is
transformers' multimodal one (`mrope_section`): for text every token's three position
components are equal, which is plain RoPE on the rotary channels, what we compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_rl.models.qwen3.config import Qwen3Config
from titan_rl.models.qwen3_hybrid.config import GdnConfig
from titan_rl.models.qwen3_next.config import NextLayout, dense_fields_from_hf

TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


def text_config(d: dict, model_types: tuple[str, ...]) -> dict:
    """The text model's keys of a config.json: itself, or its `text_config` (a vision-language
    folder's; tie_word_embeddings may sit at the top level)."""
    if d.get("model_type") not in (*model_types, None):
        raise ValueError(f"config.json model_type = {d.get('model_type')!r}, expected one of {list(model_types)}")
    if "text_config" in d:
        return {"tie_word_embeddings": d.get("tie_word_embeddings", False), **d["text_config"]}
    return d


def gdn_widths(cfg) -> dict[str, int]:
    """The widths model.tp_leaves must divide in the unfused GDN projections."""
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {"in_proj_qkv (2*linear_num_key_heads*linear_key_head_dim + linear_num_value_heads*linear_value_head_dim)":
            cfg.linear_conv_dim, "linear_num_value_heads": hv, "linear_num_value_heads*linear_value_head_dim": hv * dv}


@dataclass(frozen=True)
class Qwen35Config(Qwen3Config, GdnConfig, NextLayout):
    def validate(self) -> "Qwen35Config":
        super().validate()
        self.validate_gdn()
        self.validate_layout()
        return self

    def tp_widths(self) -> dict[str, int]:
        return {**super().tp_widths(), **gdn_widths(self)}

    def hf_config(self, architecture: str = "TitanQwen3_5ForCausalLM", dtype: str = "bfloat16") -> dict:
        d = super().hf_config(architecture, dtype)
        d.pop("rope_theta")
        d.update(model_type="qwen3_5_text", **self.gdn_hf(), **self.layout_hf())
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
