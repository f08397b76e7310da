"""Qwen3-Next's architecture config (transformers' Qwen3NextConfig keys) and its flavor: the
dense, routed-MLP, GDN and layout fields of models/common (config.py, moe.py, gdn.py, next.py)
plus the shared expert's width.

What transformers defines and we compute: gated attention (q_proj holds each head's query
and output gate), partial rotary (`partial_rotary_factor` of head_dim), zero-centred
RMSNorms (x * (1 + w)), GDN layers by `layer_types`, every MLP a routed MoE with a shared
expert and its sigmoid gate. Refused: rope types other than "default", attention bias, an
activation other than silu, dense layers between the sparse ones (decoder_sparse_step != 1
or mlp_only_layers: routes are recorded for every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_rl.models.common.config import BOS_EOS
from titan_rl.models.common.gdn import GdnConfig
from titan_rl.models.common.moe import MoeConfig, moe_fields_from_hf
from titan_rl.models.common.next import NextLayout


@dataclass(frozen=True)
class Qwen3NextConfig(MoeConfig, GdnConfig, NextLayout):
    shared_expert_intermediate_size: int = 88

    def validate(self) -> "Qwen3NextConfig":
        super().validate()
        self.validate_gdn()
        self.validate_layout()
        if self.shared_expert_intermediate_size < 1:
            raise ValueError(f"model.shared_expert_intermediate_size = {self.shared_expert_intermediate_size} "
                             "must be >= 1")
        return self

    def tp_widths(self) -> dict[str, int]:
        return {**super().tp_widths(), "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                **self.gdn_tp_widths()}

    def hf_config(self, architecture: str = "TitanQwen3NextForCausalLM", dtype: str = "bfloat16") -> dict:
        d = {**self.hf_fields(architecture, "qwen3_next", dtype), **BOS_EOS}
        d.pop("rope_theta")
        d.update(**self.gdn_hf(), **self.layout_hf(),
                 num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                 moe_intermediate_size=self.moe_intermediate_size,
                 shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                 norm_topk_prob=self.norm_topk_prob, router_aux_loss_coef=self.router_aux_loss_coef,
                 decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3NextConfig":
        if d.get("model_type", "qwen3_next") != "qwen3_next":
            raise ValueError(f"config.json model_type = {d.get('model_type')!r}, expected 'qwen3_next'")
        return cls(**moe_fields_from_hf(d), **cls.gdn_from_hf(d, "Qwen3-Next"),
                   **cls.layout_from_hf(d, int(d["num_hidden_layers"])),
                   shared_expert_intermediate_size=int(d["shared_expert_intermediate_size"])).validate()


FLAVORS: dict[str, Qwen3NextConfig] = {
    # odd sizes (hidden 200, vocab 997, 3 value heads per key head, 5 experts of 72, shared
    # expert 88): GDN, GDN, GDN, gated attention
    "debug_qwen3_next": Qwen3NextConfig(
        vocab_size=997, hidden_size=200, intermediate_size=328, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rope_theta=10_000.0, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=3, num_experts=5,
        num_experts_per_tok=2, moe_intermediate_size=72, shared_expert_intermediate_size=88),
}
