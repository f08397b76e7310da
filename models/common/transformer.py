"""The dense decoder, read top to bottom: attention, SwiGLU MLP, the pre-norm layer and the
causal-LM shell that Qwen3, Llama and the MoE / hybrid / sparse-attention models build on.

Parameter names equal Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...), so a
local HF checkpoint loads with no renaming and our checkpoints load into vLLM's built-in
models and transformers' classes.

The model runs on ONE flat stream of tokens ([T, hidden]): the trainer flattens its
[B, L] batch, vLLM hands its scheduled tokens as they are. Attention, the one row-mixing
op, is a callable the engine passes in; everything else is row-wise and goes through
`Ops` (models/ops.py), which holds the kernel mode, the TP leaf count and the
quantization recipe (ModelOptions): this file never looks at them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from titan_rl.models.common.config import DenseConfig
from titan_rl.kernels.linear_forms import Operand, fused_operands
from titan_rl.models.layers import AttentionFn, HeadRMSNorm, Linear, RMSNorm, WeightSource
from titan_rl.models.ops import Ops
from titan_rl.models.options import ModelOptions


class Attention(nn.Module):
    def __init__(self, cfg: DenseConfig, layer_idx: int, ops: Ops):
        super().__init__()
        h, hkv, d, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.layer_idx, self.h, self.hkv, self.d, self.theta = layer_idx, h, hkv, d, cfg.rope_theta
        self.ops = ops
        self.q_proj = Linear(e, h * d, ops, "col", "attention")
        self.k_proj = Linear(e, hkv * d, ops, "col", "attention")
        self.v_proj = Linear(e, hkv * d, ops, "col", "attention")
        self.o_proj = Linear(h * d, e, ops, "row", "attention")
        if cfg.qk_norm:
            self.q_norm = HeadRMSNorm(d, cfg.rms_norm_eps, ops)
            self.k_norm = HeadRMSNorm(d, cfg.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, positions, attn: AttentionFn):
        T = x.shape[0]
        q, k, v = self.ops.same_input(x, [self.q_proj, self.k_proj, self.v_proj])
        q, k, v = q.view(T, self.h, self.d), k.view(T, self.hkv, self.d), v.view(T, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rope(q, positions, self.theta), self.ops.rope(k, positions, self.theta)
        o = attn(self.layer_idx, q, k, v)
        return self.o_proj(o.reshape(T, self.h * self.d))

    def engine_operands(self, source: WeightSource) -> list[Operand]:
        """The engine's [q; k; v], prepared once per load (kernels/linear_forms.py: Fused)."""
        return fused_operands("packed_qkv", [self.q_proj, self.k_proj, self.v_proj], source)


class MLP(nn.Module):
    """SwiGLU MLP; `group`: its quantization layer group ("experts" for an MoE expert)."""

    def __init__(self, cfg: DenseConfig, ops: Ops, group: str = "mlp"):
        super().__init__()
        self.ops = ops
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, ops, "col", group)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, ops, "col", group)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, ops, "row", group)

    def forward(self, x):
        gate, up = self.ops.same_input(x, [self.gate_proj, self.up_proj])
        return self.down_proj(self.ops.silu_mul(gate, up))

    def engine_operands(self, source: WeightSource) -> list[Operand]:
        """The engine's [gate; up], prepared once per load."""
        return fused_operands("packed_gate_up", [self.gate_proj, self.up_proj], source)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block. `mlp`: another row-wise block in the MLP's place
    (the MoE model passes its routed one)."""

    def __init__(self, cfg: DenseConfig, layer_idx: int, ops: Ops, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, ops)
        self.mlp = MLP(cfg, ops) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, x, positions, attn: AttentionFn):
        x = x + self.self_attn(self.input_layernorm(x), positions, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: DenseConfig, ops: Ops, make_layer: Callable[[DenseConfig, int, Ops], nn.Module],
                 norm_offset: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(cfg, i, ops) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, offset=norm_offset)


class CausalLM(nn.Module):
    """The dense decoder LM both engines run; an architecture subclasses it (its own class is
    what the registry finds) and names its layer and final-norm form."""

    # (cfg, layer_idx, ops) -> decoder layer; the MoE and hybrid models name their own.
    make_layer = DecoderLayer
    # the final norm's form (RMSNorm.offset: Qwen3-Next / Qwen3.5's x * (1 + w))
    norm_offset = False

    def __init__(self, cfg: DenseConfig, options: ModelOptions = ModelOptions()):
        super().__init__()
        self.cfg = cfg.validate()
        options.validate().check_widths(cfg.tp_widths())
        self.options = options
        self.ops = Ops(options)
        self.model = Backbone(cfg, self.ops, type(self).make_layer, type(self).norm_offset)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, self.ops)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "CausalLM":
        g = torch.Generator().manual_seed(seed)
        offset = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, RMSNorm) and m.offset}
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):  # a scale near 1 (an offset norm's is 1 + w)
                    p.copy_((0.0 if name in offset else 1.0) + 0.1 * torch.randn(p.shape, generator=g))
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
        """fp32 logits (the engine computes them from its prepared head, kernels.lm_head_weight:
        the same bits)."""
        return self.ops.lm_head(hidden, self.lm_head.weight)

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
