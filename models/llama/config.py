"""Llama's architecture config, its flavors, and config.json both ways (transformers'
LlamaConfig keys). What this model does not compute is refused in one line by `from_hf`:
biases on the projections, an activation other than SiLU, and RoPE scaling (Llama 3.1+'s
"llama3" frequency rescaling, linear, dynamic, YaRN): the shared RoPE kernel computes plain
RoPE at `rope_theta`, and a rescaled model would silently compute other logits."""

from __future__ import annotations

from dataclasses import dataclass

from titan_rl.models.common.config import DenseConfig


@dataclass(frozen=True)
class LlamaConfig(DenseConfig):
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    qk_norm: bool = False
    # written back to config.json: vLLM stops a request at the config's EOS by itself
    bos_token_id: int = 0
    eos_token_id: int | tuple[int, ...] = 1

    def hf_config(self, architecture: str = "TitanLlamaForCausalLM", dtype: str = "bfloat16") -> dict:
        """config.json content that transformers parses as a LlamaConfig."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {**self.hf_fields(architecture, "llama", dtype), "rope_scaling": None, "mlp_bias": False,
                "bos_token_id": self.bos_token_id, "eos_token_id": eos}

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        # transformers 5 writes `rope_parameters`, older folders `rope_scaling`; either may rescale
        for key in ("rope_parameters", "rope_scaling"):
            rope_type = (d.get(key) or {}).get("rope_type", (d.get(key) or {}).get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"config.json: {key} rope type {rope_type!r} is not supported (llama's RoPE here is "
                                 "plain RoPE at rope_theta); allowed: 'default' or none")
        rope = d.get("rope_parameters") or {}
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"config.json: {key} = {d[key]!r} is not supported (the projections have no bias); "
                                 "allowed: false")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act = {d['hidden_act']!r} is not supported; allowed: 'silu'")
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10_000.0))
        eos = d.get("eos_token_id", 1)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id", 0) if d.get("bos_token_id") is not None else 0,
            eos_token_id=tuple(eos) if isinstance(eos, list) else (eos if eos is not None else 1),
        ).validate()


FLAVORS: dict[str, LlamaConfig] = {
    # ~3.7M parameters, the debug model's widths (the character-tokenizer tasks' configs)
    "debug": LlamaConfig(),
    # SmolLM2-135M(-Instruct)'s sizes (scripts/fetch_smollm2.sh converts its GGUF)
    "smollm2_135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100_000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
}
