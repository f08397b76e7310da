"""Qwen3's architecture config, its flavors, and config.json both ways (transformers'
Qwen3Config keys; how the model computes is ModelOptions', not this)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_rl.models.arch_spec import flavor_config

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    def validate(self) -> "Qwen3Config":
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"model.head_dim = {self.head_dim} is not supported; allowed: {list(SUPPORTED_HEAD_DIMS)} "
                "(the sizes vLLM's CPU attention backend accepts)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return self

    def tp_widths(self) -> dict[str, int]:
        """The widths model.tp_leaves must divide (the column blocks and K-leaves of the
        "col"/"row" linears), named as the error names them."""
        return {
            "num_attention_heads*head_dim": self.num_attention_heads * self.head_dim,
            "num_key_value_heads*head_dim": self.num_key_value_heads * self.head_dim,
            "intermediate_size": self.intermediate_size,
        }

    def hf_config(self, architecture: str = "TitanQwen3ForCausalLM", dtype: str = "bfloat16") -> dict:
        """config.json content that transformers parses as a Qwen3Config."""
        return {
            "architectures": [architecture],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": dtype,
            "dtype": dtype,
            "bos_token_id": 0,
            "eos_token_id": 1,
        }

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim", d["hidden_size"] // d["num_attention_heads"]),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
        ).validate()


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


def resolve_config(flavor, flavors: dict, arch: str, config_type: type = Qwen3Config, **overrides):
    """A flavor name or a config object (+ field overrides) -> the config to build."""
    if isinstance(flavor, str):
        flavor = flavor_config(flavors, flavor, arch)
    if not isinstance(flavor, config_type):
        raise TypeError(f"{arch} needs a {config_type.__name__}, got {type(flavor).__name__}")
    return replace(flavor, **overrides) if overrides else flavor
