"""What the Qwen3-Next family (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) shares, read top to bottom:
the layout fields (`layer_types`, partial rotary), the published folders' text-model keys,
gated attention and the family's decoder layers (models/common/gdn.py's hybrid layer with
gated attention, zero-centred RMSNorms and Qwen3-Next's or Qwen3.5's GDN projections).

Gated attention (`model.layers.N.self_attn.*`): q_proj gives each head its query and its
output gate side by side ([T, H, 2*D]); q_norm / k_norm are zero-centred; RoPE turns the
first `rotary_dim` channels of each head; the attention output times sigmoid(gate) goes
to o_proj. Every transcendental of an input whose size depends on the batch goes through
`ops.elementwise` (lane_stable in exact mode) and is rounded to the model's dtype as
transformers rounds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from titan_rl.models.common.gdn import HybridDecoderLayer, Qwen35GatedDeltaNet
from titan_rl.models.common.transformer import Attention
from titan_rl.models.layers import AttentionFn, HeadRMSNorm, Linear, sigmoid_gate
from titan_rl.models.ops import Ops


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


def text_config(d: dict, model_types: tuple[str, ...]) -> dict:
    """The text model's keys of a config.json: itself, or its `text_config` (a vision-language
    folder's; tie_word_embeddings may sit at the top level)."""
    if d.get("model_type") not in (*model_types, None):
        raise ValueError(f"config.json model_type = {d.get('model_type')!r}, expected one of {list(model_types)}")
    if "text_config" in d:
        return {"tie_word_embeddings": d.get("tie_word_embeddings", False), **d["text_config"]}
    return d


@dataclass(frozen=True)
class NextLayout:
    """The fields the Qwen3-Next family adds to the dense ones: which layers are GDN, and how
    much of a head RoPE rotates."""

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


class GatedAttention(Attention):
    def __init__(self, cfg, layer_idx: int, ops: Ops):
        nn.Module.__init__(self)
        h, hkv, d, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.layer_idx, self.h, self.hkv, self.d, self.theta = layer_idx, h, hkv, d, cfg.rope_theta
        self.rotary_dim, self.ops = cfg.rotary_dim, ops
        self.q_proj = Linear(e, h * d * 2, ops, "col", "attention")  # per head: query, then output gate
        self.k_proj = Linear(e, hkv * d, ops, "col", "attention")
        self.v_proj = Linear(e, hkv * d, ops, "col", "attention")
        self.o_proj = Linear(h * d, e, ops, "row", "attention")
        self.q_norm = HeadRMSNorm(d, cfg.rms_norm_eps, ops, offset=True)
        self.k_norm = HeadRMSNorm(d, cfg.rms_norm_eps, ops, offset=True)

    def forward(self, x, positions, attn: AttentionFn):
        T, d = x.shape[0], self.d
        qg, k, v = self.ops.same_input(x, [self.q_proj, self.k_proj, self.v_proj])
        qg = qg.view(T, self.h, 2 * d)
        q, gate = qg[..., :d].contiguous(), qg[..., d:]
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, self.hkv, d))
        v = v.view(T, self.hkv, d)
        q = self.ops.partial_rope(q, positions, self.theta, self.rotary_dim)
        k = self.ops.partial_rope(k, positions, self.theta, self.rotary_dim)
        o = attn(self.layer_idx, q, k, v).reshape(T, self.h * d)
        return self.o_proj(o * sigmoid_gate(self.ops, gate.reshape(T, self.h * d)))


class NextDecoderLayer(HybridDecoderLayer):
    attention_cls = GatedAttention
    norm_offset = True




class Qwen35DecoderLayer(NextDecoderLayer):
    """Qwen3.5's layer: Qwen3-Next's with the GDN projections unfused."""

    gdn_cls = Qwen35GatedDeltaNet
