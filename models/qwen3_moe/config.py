"""Qwen3-MoE's architecture config (the dense decoder's plus the routed MLP), flavors, config.json."""

from __future__ import annotations

from dataclasses import dataclass

from titan_rl.models.common.config import BOS_EOS, dense_fields_from_hf
from titan_rl.models.common.moe import MoeConfig


@dataclass(frozen=True)
class Qwen3MoeConfig(MoeConfig):
    """The dense and routed-MLP fields (models/common/moe.py) with Qwen3-MoE's defaults."""

    def hf_config(self, architecture: str = "TitanQwen3MoeForCausalLM", dtype: str = "bfloat16") -> dict:
        return {**self.hf_fields(architecture, "qwen3_moe", dtype), **BOS_EOS, **self.moe_hf()}

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3MoeConfig":
        if d.get("model_type", "qwen3_moe") != "qwen3_moe":
            raise ValueError(f"config.json model_type = {d.get('model_type')!r}, expected 'qwen3_moe'")
        if int(d.get("decoder_sparse_step", 1)) != 1 or list(d.get("mlp_only_layers") or []):
            raise ValueError(
                "config.json has dense layers (decoder_sparse_step != 1 or mlp_only_layers non-empty); "
                "only all-sparse Qwen3-MoE is supported"
            )
        dense = dense_fields_from_hf({**d, "intermediate_size": d.get("intermediate_size", d["moe_intermediate_size"])})
        return cls(
            **dense,
            # transformers >= 5 renames num_experts to num_local_experts in to_dict()
            num_experts=d["num_experts"] if "num_experts" in d else d["num_local_experts"],
            num_experts_per_tok=d["num_experts_per_tok"],
            moe_intermediate_size=d["moe_intermediate_size"],
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        ).validate()


FLAVORS: dict[str, Qwen3MoeConfig] = {
    # ~4.5M parameters (8 experts, top-2): trains in seconds on CPU.
    "debug_moe": Qwen3MoeConfig(),
    # ~73M parameters (16 experts, top-4, ~16M active per token): benchmarks.
    "small_moe": Qwen3MoeConfig(
        vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
    ),
}
