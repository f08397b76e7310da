"""The GDN hybrid's architecture config (Qwen3's dense fields plus the gated delta-rule layers'
of models/common/gdn.py, full attention every `full_attention_interval` layers), its
flavors, and config.json (parsed by transformers as a Qwen3Config; the GDN keys become
attributes)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_rl.models.common.config import BOS_EOS, DenseConfig, dense_fields_from_hf
from titan_rl.models.common.gdn import GdnConfig

MODEL_TYPE = "qwen3"  # config.json parses as transformers' Qwen3Config; GDN keys become attributes


@dataclass(frozen=True)
class Qwen3HybridConfig(DenseConfig, GdnConfig):
    full_attention_interval: int = 4

    # -- layout ----------------------------------------------------------------------------
    def is_full_attention(self, layer_idx: int) -> bool:
        return (layer_idx + 1) % self.full_attention_interval == 0

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if self.is_full_attention(i) else "linear_attention"
                for i in range(self.num_hidden_layers)]

    def validate(self) -> "Qwen3HybridConfig":
        super().validate()
        if self.num_hidden_layers < 1:
            raise ValueError(f"model.num_hidden_layers = {self.num_hidden_layers} must be >= 1")
        self.validate_gdn()
        n, k = self.num_hidden_layers, self.full_attention_interval
        if not 2 <= k <= n:
            raise ValueError(
                f"model.full_attention_interval = {k} must be in 2..num_hidden_layers ({n}): the hybrid needs "
                "at least one GDN layer and one full-attention layer (layer i is full attention when "
                "(i + 1) % full_attention_interval == 0)")
        return self

    def tp_widths(self) -> dict[str, int]:
        return {**super().tp_widths(), **self.gdn_tp_widths()}

    # -- config.json -------------------------------------------------------------------------
    def hf_config(self, architecture: str = "TitanQwen3HybridForCausalLM", dtype: str = "bfloat16") -> dict:
        return {**self.hf_fields(architecture, MODEL_TYPE, dtype), **BOS_EOS,
                "layer_types": self.layer_types,  # vLLM counts the layers of each kind from it
                "full_attention_interval": self.full_attention_interval, **self.gdn_hf()}

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3HybridConfig":
        gdn = cls.gdn_from_hf(d, "qwen3_hybrid")
        if "full_attention_interval" not in d:
            raise ValueError("config.json lacks the hybrid keys ['full_attention_interval'] (not a qwen3_hybrid "
                             "checkpoint?)")
        base = dense_fields_from_hf(d)
        cfg = cls(**base, **gdn, full_attention_interval=int(d["full_attention_interval"])).validate()
        if "layer_types" in d and list(d["layer_types"]) != cfg.layer_types:
            raise ValueError(f"config.json layer_types = {d['layer_types']} disagrees with full_attention_interval "
                             f"= {cfg.full_attention_interval} (expected {cfg.layer_types})")
        return cfg


FLAVORS: dict[str, Qwen3HybridConfig] = {
    # ~3.9M parameters: layers 0-2 GDN, layer 3 full attention. Trains in seconds on CPU.
    "debug_hybrid": Qwen3HybridConfig(),
    # ~50M parameters (10 layers: 8 GDN, 2 full attention): benchmarks.
    "small_hybrid": Qwen3HybridConfig(
        vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    ),
}
