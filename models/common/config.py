"""The dense decoder's config fields, shared by the architectures built on it (Qwen3, Llama
and the MoE / hybrid models): each folder's config subclasses `DenseConfig` (or a common
config built on it: models/common/moe.py, gdn.py, next.py) with its own defaults and its
config.json keys."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# config.json's special-token ids for the configs with no fields of their own for them (Llama's has)
BOS_EOS = {"bos_token_id": 0, "eos_token_id": 1}

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class DenseConfig:
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
    qk_norm: bool = True  # per-head RMSNorm of q and k before RoPE (Qwen3: yes; Llama: no)

    def validate(self):
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

    def hf_fields(self, architecture: str, model_type: str, dtype: str) -> dict:
        """The config.json entries every dense decoder's transformers config reads alike."""
        return {
            "architectures": [architecture],
            "model_type": model_type,
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
        }

    def tp_widths(self) -> dict[str, int]:
        """The widths model.tp_leaves must divide (the column blocks and K-leaves of the
        "col"/"row" linears), named as the error names them."""
        return {
            "num_attention_heads*head_dim": self.num_attention_heads * self.head_dim,
            "num_key_value_heads*head_dim": self.num_key_value_heads * self.head_dim,
            "intermediate_size": self.intermediate_size,
        }


def dense_fields_from_hf(d: dict) -> dict:
    """The dense fields of a Qwen-family config.json (transformers' Qwen3Config keys; rope_theta
    from rope_parameters where it is there), checked; q/k norm on."""
    rope_theta = d.get("rope_theta")
    if rope_theta is None:
        rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
    return asdict(DenseConfig(
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
    ).validate())
