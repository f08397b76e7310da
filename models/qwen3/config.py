"""Qwen3's architecture config, its flavors, and config.json both ways (transformers'
Qwen3Config keys; how the model computes is ModelOptions', not this)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_rl.models.common.config import BOS_EOS, DenseConfig, dense_fields_from_hf

__all__ = ["FLAVORS", "Qwen3Config"]


@dataclass(frozen=True)
class Qwen3Config(DenseConfig):
    """The dense fields (models/common/config.py) with Qwen3's defaults: q/k norm on."""

    def hf_config(self, architecture: str = "TitanQwen3ForCausalLM", dtype: str = "bfloat16") -> dict:
        """config.json content that transformers parses as a Qwen3Config."""
        return {**self.hf_fields(architecture, "qwen3", dtype), **BOS_EOS}

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        return cls(**dense_fields_from_hf(d)).validate()


FLAVORS: dict[str, Qwen3Config] = {
    # ~3.7M parameters: trains in seconds on CPU.
    "debug": Qwen3Config(),
    # ~48M parameters: benchmarks.
    "small": Qwen3Config(
        vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    ),
    # The real Qwen3 sizes (load their weights from a local HF folder).
    "0.6B": Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "1.7B": Qwen3Config(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "8B": Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
}

