"""Qwen3 hybrid, read top to bottom: gated delta-rule linear attention (GDN) layers
interleaved with qwen3's full attention (layer i is full attention when
(i + 1) % full_attention_interval == 0). docs/gdn.md has the layer's equations, the
state protocol and why each op is written as it is.

Like qwen3 the model computes on ONE flat token stream; besides the attention callable
the engine passes a `LinearState` (where sequences start, the states they carry in, where
their final states go). The trainer passes none: `FreshState.from_positions` starts a
sequence at every position 0 from zero state. Names are Qwen3-Next's
(`model.layers.N.linear_attn.*`).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from titan_rl.kernels.gdn import causal_conv1d
from titan_rl.kernels.reduction import broadcast_rows
from titan_rl.models.layers import AttentionFn, Linear, RMSNorm
from titan_rl.models.ops import Ops
from titan_rl.models.qwen3.model import MLP, Attention, Qwen3ForCausalLM
from titan_rl.models.qwen3_hybrid.config import Qwen3HybridConfig


# -- the state protocol the engines implement ------------------------------------------------

class LinearState(Protocol):
    cu_seqlens: torch.Tensor  # int64 [N + 1]

    def initial(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]: ...

    def store(self, layer_idx: int, conv_state: torch.Tensor, rec_state: torch.Tensor) -> None: ...


class FreshState:
    """Every sequence starts from zero state; nothing is stored (the trainer)."""

    def __init__(self, cu_seqlens: torch.Tensor):
        self.cu_seqlens = cu_seqlens

    @classmethod
    def from_positions(cls, positions: torch.Tensor) -> "FreshState":
        """A sequence starts at row 0 and at every row whose position is 0."""
        T = positions.shape[0]
        starts = (positions == 0).nonzero().flatten()
        if T and (starts.numel() == 0 or int(starts[0]) != 0):
            starts = torch.cat([starts.new_zeros(1), starts])
        return cls(torch.cat([starts, starts.new_full((1,), T)]).to(torch.int64))

    def initial(self, layer_idx):
        return None, None

    def store(self, layer_idx, conv_state, rec_state):
        pass


# -- the GDN layer -----------------------------------------------------------------------------

class CausalConv1d(nn.Module):
    """The depthwise causal conv's weight (no bias), [C, 1, K] as nn.Conv1d(groups=C)
    stores it; GatedDeltaNet calls the kernel with it (through head_params)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * weight (kernels.rms_norm, rounded to x's dtype), times silu(z) in fp32,
    rounded to x's dtype (Qwen3-Next's RMSNormGated). `weight`: the one to compute with
    (GatedDeltaNet.head_params). `tp_gather`: under TP, joins the ranks' heads for the
    weight gradient (Ops.head_rms_norm)."""

    tp_gather = None

    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x, z, weight: torch.Tensor):
        y = self.ops.head_rms_norm(x, weight, self.eps, self.tp_gather)
        return (y.float() * self.ops.elementwise(F.silu, z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen3HybridConfig, layer_idx: int, ops: Ops):
        super().__init__()
        self.layer_idx, self.ops = layer_idx, ops
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.r = self.hv // self.hk
        e = cfg.hidden_size
        self.in_proj_qkvz = Linear(e, cfg.linear_qkvz_dim, ops, "col", "linear_attention")
        # the gates (beta, decay) stay high precision: their error compounds along the recurrence
        self.in_proj_ba = Linear(e, 2 * self.hv, ops, "col")
        self.conv1d = CausalConv1d(cfg.linear_conv_dim, cfg.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, ops)
        self.out_proj = Linear(self.hv * self.dv, e, ops, "row", "linear_attention")

    def head_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv weight, A_log, dt_bias, norm weight) for the heads this layer computes
        (self.hk key heads, self.hv value heads): here all of them; a tensor-parallel rank
        gives its own heads' share (titan_rl/titan/parallelize.py)."""
        return self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections of x [n, E]: (q | k | v of all heads [n, conv channels], z [n, Hv*dv],
        b [n, Hv], a [n, Hv]). Qwen3-Next's grouped layout: in_proj_qkvz / in_proj_ba hold
        each key head's q, k, v, z / b, a together."""
        n, hk, hv, dk, dv, r = x.shape[0], self.hk, self.hv, self.dk, self.dv, self.r
        qkvz = self.in_proj_qkvz(x).view(n, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(n, hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, hk * dk), k.reshape(n, hk * dk), v.reshape(n, hv * dv)], dim=-1)
        return mixed, z.reshape(n, hv * dv), b.reshape(n, hv), a.reshape(n, hv)

    def forward(self, x, state: LinearState):
        T = x.shape[0]
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        cu = state.cu_seqlens
        n = int(cu[-1])
        mixed, z, b, a = self.project(x[:n])

        conv_w, A_log, dt_bias, norm_w = self.head_params()
        conv0, rec0 = state.initial(self.layer_idx)
        y, conv1 = causal_conv1d(mixed, conv_w, cu, conv0)
        ops = self.ops
        y = ops.elementwise(F.silu, y).to(mixed.dtype)  # lane_stable computes in fp32
        q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = ops.gdn_l2norm(q.reshape(n, hk, dk))
        k = ops.gdn_l2norm(k.reshape(n, hk, dk))
        v = v.reshape(n, hv, dv)
        beta = ops.elementwise(torch.sigmoid, b.reshape(n, hv).float())
        # per-head parameters broadcast over tokens: gradients by a fixed sum over the n tokens
        decay = broadcast_rows(ops.elementwise(torch.exp, A_log.float()), n)
        g = -decay * ops.elementwise(F.softplus, a.reshape(n, hv).float() + broadcast_rows(dt_bias.float(), n))
        o, rec1 = ops.gdn_recurrence(q, k, v, g, beta, cu, rec0, scale=1.0 / math.sqrt(dk))
        state.store(self.layer_idx, conv1, rec1)

        o = self.norm(o, z.reshape(n, hv, dv), norm_w)
        out = self.out_proj(o.reshape(n, hv * dv))
        if n < T:  # padding rows of the engine's stream
            out = torch.cat([out, out.new_zeros(T - n, out.shape[1])])
        return out


class HybridDecoderLayer(nn.Module):
    """qwen3's decoder layer with the token mixer chosen by the layer index. The Qwen3-Next
    family's layers are this one with other parts (class attributes; `mlp`: a routed block)."""

    attention_cls: type = Attention
    gdn_cls: type = GatedDeltaNet
    norm_offset = False

    def __init__(self, cfg: Qwen3HybridConfig, layer_idx: int, ops: Ops, mlp: nn.Module | None = None):
        super().__init__()
        self.is_full_attention = cfg.is_full_attention(layer_idx)
        if self.is_full_attention:
            self.self_attn = self.attention_cls(cfg, layer_idx, ops)
        else:
            self.linear_attn = self.gdn_cls(cfg, layer_idx, ops)
        self.mlp = MLP(cfg, ops) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, offset=self.norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, offset=self.norm_offset)

    def forward(self, x, positions, attn: AttentionFn, state: LinearState):
        h = self.input_layernorm(x)
        if self.is_full_attention:
            x = x + self.self_attn(h, positions, attn)
        else:
            x = x + self.linear_attn(h, state)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3HybridForCausalLM(Qwen3ForCausalLM):
    """qwen3's LM (construction, logits, the trainer's forward) over hybrid layers."""

    make_layer = HybridDecoderLayer

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "Qwen3HybridForCausalLM":
        """qwen3's init, then GDN-specific values: A = exp(A_log) ~ U(1, 16) and dt_bias =
        softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1] (so the decay exp(g) starts
        in about [0.2, 0.999]), conv weights ~ N(0, 1/K)."""
        super().init_weights(seed, std)
        g = torch.Generator().manual_seed(seed + 0x6D2B)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("linear_attn.A_log"):
                    p.copy_(torch.log(1.0 + 15.0 * torch.rand(p.shape, generator=g)))
                elif name.endswith("linear_attn.dt_bias"):
                    dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(p.shape, generator=g))
                    p.copy_(dt + torch.log(-torch.expm1(-dt)))
                elif name.endswith("linear_attn.conv1d.weight"):
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        return self

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                      inputs_embeds: torch.Tensor | None = None, state: LinearState | None = None) -> torch.Tensor:
        """The flat-stream forward both engines share. `state=None`: FreshState.from_positions."""
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if state is None:
            state = FreshState.from_positions(positions)
        for layer in self.model.layers:
            x = layer(x, positions, attn, state)
        return self.model.norm(x)

