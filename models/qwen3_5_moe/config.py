"""Qwen3.5-MoE's text model config (transformers' Qwen3_5MoeTextConfig keys), its flavor.
Qwen3.5's layers with Qwen3-Next's MoE (a shared expert; the router always renormalises
its top-k probabilities: norm_topk_prob)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_rl.models.common.config import BOS_EOS
from titan_rl.models.common.gdn import GdnConfig
from titan_rl.models.common.moe import MoeConfig, moe_fields_from_hf
from titan_rl.models.common.next import NextLayout, text_config

TEXT_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")


@dataclass(frozen=True)
class Qwen35MoeConfig(MoeConfig, GdnConfig, NextLayout):
    shared_expert_intermediate_size: int = 88

    def validate(self) -> "Qwen35MoeConfig":
        super().validate()
        self.validate_gdn()
        self.validate_layout()
        if not self.norm_topk_prob:
            raise ValueError("model.norm_topk_prob = false: Qwen3.5-MoE's router always renormalises its top-k")
        return self

    def tp_widths(self) -> dict[str, int]:
        return {**super().tp_widths(), "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                **self.gdn_tp_widths(fused=False)}

    def hf_config(self, architecture: str = "TitanQwen3_5MoeForCausalLM", dtype: str = "bfloat16") -> dict:
        d = {**self.hf_fields(architecture, "qwen3_5_moe_text", dtype), **BOS_EOS, **self.moe_hf()}
        for key in ("rope_theta", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            d.pop(key)
        d.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                 **self.gdn_hf(), **self.layout_hf())
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen35MoeConfig":
        d = text_config(d, TEXT_MODEL_TYPES)
        return cls(**moe_fields_from_hf(d, norm_topk_prob=True), **cls.gdn_from_hf(d, "Qwen3.5-MoE"),
                   **cls.layout_from_hf(d, int(d["num_hidden_layers"])),
                   shared_expert_intermediate_size=int(d["shared_expert_intermediate_size"])).validate()


FLAVORS: dict[str, Qwen35MoeConfig] = {
    # odd sizes (hidden 200, vocab 997, 5 experts of 72, shared expert 88, 3 value heads per
    # key head): GDN, GDN, GDN, gated attention
    "debug_qwen35_moe": Qwen35MoeConfig(
        vocab_size=997, hidden_size=200, intermediate_size=328, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rope_theta=10_000.0, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=3, num_experts=5,
        num_experts_per_tok=2, moe_intermediate_size=72, shared_expert_intermediate_size=88),
}
