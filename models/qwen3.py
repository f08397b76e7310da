"""Qwen3 dense decoder, read top to bottom.

Parameter names equal Hugging Face Qwen3's (`model.layers.0.self_attn.q_proj.weight`,
...), so a local HF checkpoint loads with no renaming and our checkpoints load into
vLLM's built-in Qwen3 and transformers' Qwen3ForCausalLM.

The model runs on ONE flat stream of tokens ([T, hidden]): the trainer flattens its
[B, L] batch, vLLM hands its scheduled tokens as they are. Every row-mixing op
(attention) is a callable passed in by the engine adapter; everything else is
row-wise and goes through `Ops` (models/ops.py), so both engines compute each token
with the same arithmetic.

`kernels = "exact"` makes Ops the batch-invariant kernels; `"stock"` plain torch
(F.linear, SDPA) for measuring what exactness costs and what it removes. This file
never looks at the mode: every function that depends on it is an Ops attribute.

`tp_leaves = L > 0` (exact mode only) computes the column-parallel linears (q/k/v/gate/up)
as L fixed column blocks and the row-parallel ones (o/down) as L K-leaves summed by a
fixed fp32 tree (kernels/matmul/torch_impl.py). The trainer's tensor-parallel layers
compute the same pieces on any TP degree dividing L (titan_rl/titan/tp_linear.py), so
trainer TP = 1, 2, ..., L and the rollout engine (which builds this model from the
config.json key "titan_tp_leaves") give the same bits. L = 0: one `linear` per layer.

`quant_recipe` / `quant_layers` (config.json key "titan_quantization"): the decoder linears
of those layer groups run the recipe (kernels/quant, docs/quantization.md). The trainer
keeps its master weight and fake-quantizes weight and input per call (straight-through
gradient); the engine holds the weight quantized (`Linear.qweight`, set by its loader) and
dequantizes it per call. Both feed the same operands to the same `linear`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from titan_rl.kernels.mode import KernelMode, check_kernels
from titan_rl.kernels.quant.recipes import QUANT_LAYERS, QUANT_RECIPES, QuantLayer, QuantRecipe
from titan_rl.models.ops import Ops

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
    # 0, or L = a power of two dividing the column-/row-parallel widths: compute
    # q/k/v/gate/up as L column blocks and o/down as L K-leaves (TP-invariant; exact mode).
    tp_leaves: int = 0
    # the quantization recipe of the decoder linears in quant_layers (exact mode; "none": off)
    quant_recipe: QuantRecipe = "none"
    quant_layers: tuple[QuantLayer, ...] = QUANT_LAYERS

    def validate(self) -> "Qwen3Config":
        if self.quant_recipe not in QUANT_RECIPES:
            raise ValueError(f"quantization.recipe = {self.quant_recipe!r} is not allowed; allowed: "
                             f"{list(QUANT_RECIPES)}")
        bad = [g for g in self.quant_layers if g not in QUANT_LAYERS]
        if bad:
            raise ValueError(f"quantization.layers = {list(self.quant_layers)}: {bad} not allowed; allowed: "
                             f"{list(QUANT_LAYERS)}")
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
        L = self.tp_leaves
        if L:
            if L < 0 or L & (L - 1):
                raise ValueError(f"model.tp_leaves = {L} must be 0 or a power of two")
            widths = {
                "num_attention_heads*head_dim": self.num_attention_heads * self.head_dim,
                "num_key_value_heads*head_dim": self.num_key_value_heads * self.head_dim,
                "intermediate_size": self.intermediate_size,
            }
            for name, n in widths.items():
                if n % L:
                    raise ValueError(f"model.tp_leaves = {L} must divide {name} = {n}")
        elif L < 0:
            raise ValueError(f"model.tp_leaves = {L} must be 0 or a power of two")
        return self

    def hf_config(self, architecture: str = "TitanQwen3ForCausalLM", dtype: str = "bfloat16") -> dict:
        """config.json content that transformers parses as a Qwen3Config (plus
        "titan_tp_leaves" when tp_leaves > 0, which transformers keeps as an attribute)."""
        d = {
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
        if self.tp_leaves > 0:
            d["titan_tp_leaves"] = self.tp_leaves
        if self.quant_recipe != "none":
            d["titan_quantization"] = {"recipe": self.quant_recipe, "layers": list(self.quant_layers)}
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        quant = d.get("titan_quantization") or {}
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
            tp_leaves=int(d.get("titan_tp_leaves") or 0),
            quant_recipe=quant.get("recipe", "none"),
            quant_layers=tuple(quant.get("layers", QUANT_LAYERS)),
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

# (layer_index, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x):
        return self.ops.rms_norm(x, self.weight, self.eps)


class HeadRMSNorm(RMSNorm):
    """RMSNorm of per-head vectors [..., H, D] by one weight shared by the heads (q_norm,
    k_norm): Ops.head_rms_norm."""

    def forward(self, x):
        return self.ops.head_rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """nn.Linear's parameter layout (weight [out, in], no bias) over the kernel linear.
    `kind`: "col" (output columns split under TP), "row" (reduction dim split) or
    "plain"; see Ops.linear_for. `group`: the quantization layer group it belongs to
    (None: never quantized); `recipe` is what Ops says that group runs."""

    KINDS = ("plain", "col", "row")

    def __init__(self, d_in: int, d_out: int, ops: Ops, kind: str = "plain", group: QuantLayer | None = None):
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"Linear kind = {kind!r}; allowed: {self.KINDS}")
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.ops, self.kind, self.shape = ops, kind, (d_out, d_in)
        self.recipe = ops.recipe_for(group)
        self.quant_input = False
        if self.recipe is not None:
            from titan_rl.kernels.quant import check_linear_shape, quantizes_activations

            check_linear_shape(self.recipe, d_out, d_in)
            self.quant_input = quantizes_activations(self.recipe)
        # The engine's `weight` prepared for the GEMM once per load (kernels.matmul
        # PackedWeight: the same bits as preparing it per call, as the trainer does).
        self.gemm_weight = None
        # The engine's quantized weight (kernels.quant.QuantizedWeight; `weight` is then None).
        self.qweight = None

    def operand_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input the GEMM sees: per-row fake-quantized when the recipe quantizes inputs."""
        if not self.quant_input:
            return x
        from titan_rl.kernels.quant import fake_quantize

        return fake_quantize(x, self.recipe, "activation")

    def operand_weight(self) -> torch.Tensor:
        """The weight the GEMM sees: the held payload dequantized (engine), the master
        fake-quantized (trainer), or the weight itself (no recipe)."""
        if self.qweight is not None:
            return self.qweight.dense()
        if self.recipe is None:
            return self.weight
        from titan_rl.kernels.quant import fake_quantize

        return fake_quantize(self.weight, self.recipe, "weight")

    def forward(self, x):
        fn = self.ops.linear_for(self.kind)
        if self.recipe is not None:
            return fn(self.operand_input(x), self.operand_weight())
        if self.gemm_weight is not None and fn is self.ops.linear:
            return fn(x, self.gemm_weight)
        return fn(x, self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer_idx: int, ops: Ops):
        super().__init__()
        h, hkv, d, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.layer_idx, self.h, self.hkv, self.d, self.theta = layer_idx, h, hkv, d, cfg.rope_theta
        self.ops = ops
        self.q_proj = Linear(e, h * d, ops, "col", "attention")
        self.k_proj = Linear(e, hkv * d, ops, "col", "attention")
        self.v_proj = Linear(e, hkv * d, ops, "col", "attention")
        self.o_proj = Linear(h * d, e, ops, "row", "attention")
        self.q_norm = HeadRMSNorm(d, cfg.rms_norm_eps, ops)
        self.k_norm = HeadRMSNorm(d, cfg.rms_norm_eps, ops)
        self.packed_qkv = None  # engine: [q; k; v] weights prepared once (Ops.same_input)

    def forward(self, x, positions, attn: AttentionFn):
        T = x.shape[0]
        q, k, v = self.ops.same_input(x, [self.q_proj, self.k_proj, self.v_proj], self.packed_qkv)
        q = self.q_norm(q.view(T, self.h, self.d))
        k = self.k_norm(k.view(T, self.hkv, self.d))
        v = v.view(T, self.hkv, self.d)
        q, k = self.ops.rope(q, positions, self.theta), self.ops.rope(k, positions, self.theta)
        o = attn(self.layer_idx, q, k, v)
        return self.o_proj(o.reshape(T, self.h * self.d))


class MLP(nn.Module):
    """SwiGLU MLP; `group`: its quantization layer group ("experts" for an MoE expert)."""

    def __init__(self, cfg: Qwen3Config, ops: Ops, group: QuantLayer = "mlp"):
        super().__init__()
        self.ops = ops
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, ops, "col", group)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, ops, "col", group)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, ops, "row", group)
        self.packed_gate_up = None  # engine: [gate; up] weights prepared once (Ops.same_input)

    def forward(self, x):
        gate, up = self.ops.same_input(x, [self.gate_proj, self.up_proj], self.packed_gate_up)
        return self.down_proj(self.ops.silu_mul(gate, up))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block. `mlp`: another row-wise block in the MLP's place
    (the MoE model passes its routed one)."""

    def __init__(self, cfg: Qwen3Config, layer_idx: int, ops: Ops, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, ops)
        self.mlp = MLP(cfg, ops) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, x, positions, attn: AttentionFn):
        x = x + self.self_attn(self.input_layernorm(x), positions, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops: Ops, make_layer: Callable[[Qwen3Config, int, Ops], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(cfg, i, ops) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class Qwen3ForCausalLM(nn.Module):
    # (cfg, layer_idx, ops) -> decoder layer; the MoE and hybrid models name their own.
    make_layer = DecoderLayer

    def __init__(self, cfg: Qwen3Config, kernels: KernelMode = "exact"):
        super().__init__()
        self.cfg = cfg.validate()
        self.ops = Ops(check_kernels(kernels), cfg.tp_leaves, cfg.quant_recipe, cfg.quant_layers)
        self.model = Backbone(cfg, self.ops, type(self).make_layer)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, self.ops)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "Qwen3ForCausalLM":
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    # -- the flat-stream forward both engines share -------------------------------------
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                      inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.model.layers:
            x = layer(x, positions, attn)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits. The engine passes a cached fp32 weight through `lm_head_fp32`."""
        return self.ops.lm_head(hidden, self.lm_head.weight.float())

    # -- the trainer's batched forward -----------------------------------------------------
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, L] (each row starts at position 0) -> fp32 logits [B, L, V]."""
        B, L = tokens.shape
        positions = torch.arange(L, device=tokens.device).repeat(B)
        scale = 1.0 / math.sqrt(self.cfg.head_dim)

        def attn(_layer, q, k, v):
            shape = lambda t: t.view(B, L, *t.shape[1:])  # noqa: E731
            o = self.ops.causal_attention(shape(q), shape(k), shape(v), scale)
            return o.reshape(B * L, *o.shape[2:])

        h = self.hidden_states(tokens.reshape(-1), positions, attn)
        return self.logits(h).view(B, L, -1)


def resolve_config(flavor, flavors: dict, arch: str, config_type: type = Qwen3Config, **overrides):
    """A flavor name or a config object (+ field overrides) -> the config to build."""
    if isinstance(flavor, str):
        if flavor not in flavors:
            raise ValueError(f"model.flavor = {flavor!r} is unknown for {arch}; allowed: {sorted(flavors)}")
        flavor = flavors[flavor]
    if not isinstance(flavor, config_type):
        raise TypeError(f"{arch} needs a {config_type.__name__}, got {type(flavor).__name__}")
    return replace(flavor, **overrides) if overrides else flavor


def build(flavor: str | Qwen3Config, kernels: KernelMode = "exact", **overrides) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(resolve_config(flavor, FLAVORS, "qwen3", **overrides), kernels)
