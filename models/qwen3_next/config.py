"""Qwen3-Next's architecture config (transformers' Qwen3NextConfig keys), its flavor, and
the pieces of it the Qwen3.5 configs share: `layer_types`, partial rotary, rope parameters.

What transformers defines and we compute: gated attention (q_proj holds each head's query
and output gate), partial rotary (`partial_rotary_factor` of head_dim), zero-centred
RMSNorms (x * (1 + w)), GDN layers by `layer_types`, every MLP a routed MoE with a shared
expert and its sigmoid gate. Refused: rope types other than "default", attention bias, an
activation other than silu, dense layers between the sparse ones (decoder_sparse_step != 1
or mlp_only_layers: routes are recorded for every layer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from titan_rl.models.qwen3.config import Qwen3Config
from titan_rl.models.qwen3_hybrid.config import GdnConfig
from titan_rl.models.qwen3_moe.config import Qwen3MoeConfig


def text_key(name: str) -> str | None:
    """The family's tensor name in a published folder -> ours, in both engines (the
    architectures' checkpoint_key): a vision-language folder's (Qwen3.5) text model sits
    under `model.language_model.`; None for the vision tower and the multi-token-prediction
    head (Qwen3.5's and Qwen3-Next's `mtp.*`), which titan_rl does not train or serve; a
    text folder's name as is."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    if name.startswith(("model.visual.", "mtp.")):
        return None
    return name


@dataclass(frozen=True)
class NextLayout:
    """The fields the Qwen3-Next family adds to qwen3's: which layers are GDN, and how much
    of a head RoPE rotates."""

    layer_types: tuple[str, ...] = ("linear_attention", "linear_attention", "linear_attention", "full_attention")
    partial_rotary_factor: float = 0.25

    def is_full_attention(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "full_attention"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def validate_layout(self) -> None:
        self.check_layer_types(self.layer_types, self.num_hidden_layers)
        rd = self.rotary_dim
        if not 0 < rd <= self.head_dim or rd % 2:
            raise ValueError(f"partial_rotary_factor = {self.partial_rotary_factor}: head_dim ({self.head_dim}) x it "
                             f"= {rd} rotary channels; need an even number in 2..head_dim")

    def layout_hf(self) -> dict:
        return {"layer_types": list(self.layer_types), "partial_rotary_factor": self.partial_rotary_factor,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                    "partial_rotary_factor": self.partial_rotary_factor}}

    @staticmethod
    def layout_from_hf(d: dict, n_layers: int) -> dict:
        """layer_types (or the full_attention_interval it is derived from) and the rotary
        fields of a config.json, refusing what our kernels do not compute."""
        rope = d.get("rope_parameters") or {}
        kind = rope.get("rope_type", d.get("rope_type", "default"))
        if kind != "default":
            raise ValueError(f"config.json rope_parameters.rope_type = {kind!r} is not supported; allowed: ['default']")
        for key, want in (("hidden_act", "silu"), ("attention_bias", False)):
            if d.get(key, want) != want:
                raise ValueError(f"config.json {key} = {d[key]!r} is not supported; allowed: {want!r}")
        types = d.get("layer_types")
        if types is None:
            k = int(d.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n_layers)]
        factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        return {"layer_types": tuple(types), "partial_rotary_factor": float(factor)}


@dataclass(frozen=True)
class Qwen3NextConfig(Qwen3MoeConfig, GdnConfig, NextLayout):
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
        hv = self.linear_num_value_heads
        return {
            **super().tp_widths(),
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "in_proj_qkvz (2*linear_num_key_heads*linear_key_head_dim + "
            "2*linear_num_value_heads*linear_value_head_dim)": self.linear_qkvz_dim,
            "in_proj_ba (2*linear_num_value_heads)": 2 * hv,
            "linear_num_value_heads*linear_value_head_dim": hv * self.linear_value_head_dim,
        }

    def hf_config(self, architecture: str = "TitanQwen3NextForCausalLM", dtype: str = "bfloat16") -> dict:
        d = Qwen3Config.hf_config(self, architecture, dtype)
        d.pop("rope_theta")
        d.update(model_type="qwen3_next", **self.gdn_hf(), **self.layout_hf(),
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


def moe_fields_from_hf(d: dict, norm_topk_prob: bool | None = None) -> dict:
    """qwen3's and the routed MLP's fields of a config.json whose every layer is sparse."""
    if int(d.get("decoder_sparse_step", 1)) != 1 or list(d.get("mlp_only_layers") or []):
        raise ValueError("config.json has dense layers (decoder_sparse_step != 1 or mlp_only_layers non-empty); "
                         "every layer must be sparse (routes are recorded for every layer)")
    dense = Qwen3Config.from_hf({**d, "intermediate_size": d.get("intermediate_size", d["moe_intermediate_size"])})
    return {**asdict(dense), "num_experts": int(d["num_experts"]), "num_experts_per_tok": int(d["num_experts_per_tok"]),
            "moe_intermediate_size": int(d["moe_intermediate_size"]),
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)) if norm_topk_prob is None else norm_topk_prob,
            "router_aux_loss_coef": float(d.get("router_aux_loss_coef", 0.001))}


def dense_fields_from_hf(d: dict) -> dict:
    """qwen3's fields of a config.json (rope_theta from rope_parameters where it is there)."""
    return asdict(Qwen3Config.from_hf(d))


FLAVORS: dict[str, Qwen3NextConfig] = {
    # odd sizes (hidden 200, vocab 997, 3 value heads per key head, 5 experts of 72, shared
    # expert 88): GDN, GDN, GDN, gated attention
    "debug_qwen3_next": Qwen3NextConfig(
        vocab_size=997, hidden_size=200, intermediate_size=328, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rope_theta=10_000.0, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=3, num_experts=5,
        num_experts_per_tok=2, moe_intermediate_size=72, shared_expert_intermediate_size=88),
}
