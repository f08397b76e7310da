"""The gated delta-rule linear attention (GDN) of the hybrid models, read top to bottom: its
config fields, the state protocol the engines implement, the layer (Qwen3-Next's grouped
projections, and Qwen3.5's unfused ones), the decoder layer that picks attention or GDN by
the layer index and the hybrid causal-LM shell. docs/gdn.md has the layer's equations, the
state protocol and why each op is written as it is.

Like the dense model a hybrid computes on ONE flat token stream; besides the attention
callable the engine passes a `LinearState` (where sequences start, the states they carry in,
where their final states go). The trainer passes none: `FreshState.from_positions` starts a
sequence at every position 0 from zero state. Names are Qwen3-Next's
(`model.layers.N.linear_attn.*`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from titan_rl.kernels.gdn.cache_rows import CacheRows, gather_rows
from titan_rl.kernels.reduction import broadcast_rows
from titan_rl.models.common.transformer import MLP, Attention, CausalLM
from titan_rl.models.layers import AttentionFn, Linear, RMSNorm
from titan_rl.models.ops import Ops

# The GDN kernel reduces over dk with a power-of-two halving tree (other sizes are padded)
# and keeps a [dk, dv] fp32 state per head and sequence: powers of two up to 256.
SUPPORTED_LINEAR_HEAD_DIMS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class GdnConfig:
    """The gated delta-rule layers' fields (Qwen3-Next's config.json names), shared by every
    hybrid's config: their validation, widths, state shapes and config.json keys."""

    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4

    GDN_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim")

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the conv (and of its state): q, k and v of all heads."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_qkvz_dim(self) -> int:
        """Width of q, k, v and z of all heads (in_proj_qkvz's output)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            2 * self.linear_num_value_heads * self.linear_value_head_dim

    def linear_state_shapes(self, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per-sequence state of one GDN layer: conv [C, K-1], recurrent [Hv, dk, dv] (both
        fp32); `tp` > 1: one tensor-parallel rank's share (its heads' channels and heads)."""
        return ((self.linear_conv_dim // tp, self.linear_conv_kernel_dim - 1),
                (self.linear_num_value_heads // tp, self.linear_key_head_dim, self.linear_value_head_dim))

    def validate_gdn(self) -> None:
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key} = {getattr(self, key)} must be >= 1")
        hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
        if hv % hk:
            raise ValueError(
                f"model.linear_num_value_heads = {hv} must be a multiple of model.linear_num_key_heads = {hk} "
                "(each key head serves linear_num_value_heads / linear_num_key_heads value heads)")
        for key in ("linear_key_head_dim", "linear_value_head_dim"):
            if getattr(self, key) not in SUPPORTED_LINEAR_HEAD_DIMS:
                raise ValueError(f"model.{key} = {getattr(self, key)} is not supported; allowed: "
                                 f"{list(SUPPORTED_LINEAR_HEAD_DIMS)}")
        if not 2 <= self.linear_conv_kernel_dim <= 8:
            raise ValueError(f"model.linear_conv_kernel_dim = {self.linear_conv_kernel_dim} is not supported; "
                             "allowed: 2..8")

    def gdn_tp_widths(self, fused: bool = True) -> dict[str, int]:
        """The widths model.tp_leaves must divide in the GDN projections: the grouped
        in_proj_qkvz / in_proj_ba (Qwen3-Next's, `fused`) or the unfused in_proj_qkv / z / b / a
        (Qwen3.5's)."""
        hv, dv = self.linear_num_value_heads, self.linear_value_head_dim
        if fused:
            return {
                "in_proj_qkvz (2*linear_num_key_heads*linear_key_head_dim + "
                "2*linear_num_value_heads*linear_value_head_dim)": self.linear_qkvz_dim,
                "in_proj_ba (2*linear_num_value_heads)": 2 * hv,
                "linear_num_value_heads*linear_value_head_dim": hv * dv,
            }
        # in_proj_qkv's q, k and v rows are column blocks each (Qwen35GatedDeltaNet.project_qkv)
        return {"linear_num_key_heads*linear_key_head_dim": self.linear_num_key_heads * self.linear_key_head_dim,
                "linear_num_value_heads": hv, "linear_num_value_heads*linear_value_head_dim": hv * dv}

    def check_layer_types(self, layer_types, n_layers: int) -> None:
        """A hybrid's layer_types: one entry per layer, each "linear_attention" or "full_attention"."""
        allowed = ("linear_attention", "full_attention")
        if len(layer_types) != n_layers or any(t not in allowed for t in layer_types):
            raise ValueError(f"layer_types = {list(layer_types)}: needs num_hidden_layers = {n_layers} entries, each "
                             f"one of {list(allowed)}")

    def gdn_hf(self) -> dict:
        return {key: getattr(self, key) for key in self.GDN_FIELDS}

    @classmethod
    def gdn_from_hf(cls, d: dict, what: str) -> dict:
        missing = [key for key in cls.GDN_FIELDS if key not in d]
        if missing:
            raise ValueError(f"config.json lacks the hybrid keys {missing} (not a {what} checkpoint?)")
        return {key: int(d[key]) for key in cls.GDN_FIELDS}



# -- the state protocol the engines implement ------------------------------------------------

class LinearState(Protocol):
    """Where sequences start and the states they carry in and out. `initial` gives each
    sequence's (conv, recurrent) state as a tensor (None: zeros) or as a `CacheRows` (the states
    in the engine's cache rows, which the GDN kernels update in place and return as their final
    state). `store` keeps the final ones for the next step."""

    cu_seqlens: torch.Tensor  # int64 [N + 1]

    def initial(self, layer_idx: int) -> tuple[torch.Tensor | CacheRows | None, torch.Tensor | CacheRows | None]: ...

    def store(self, layer_idx: int, conv_state: torch.Tensor | CacheRows, rec_state: torch.Tensor | CacheRows) -> None: ...


def carried_states(conv_cache: torch.Tensor, rec_cache: torch.Tensor, rows: torch.Tensor,
                   has_context: torch.Tensor) -> tuple[CacheRows | torch.Tensor | None, CacheRows | torch.Tensor | None]:
    """An engine's `LinearState.initial`: each sequence's (conv, recurrent) states as `CacheRows`
    over their cache rows, which the GDN kernels read and write in place (a Qwen3.5-0.8B decode
    step of 8 sequences, bf16, 1 thread: 403 ms with the recurrent states gathered and stored,
    335 ms in place); gathered where a row is a padding row (< 0, wrapping as indexing does):
    zeros where a sequence has no context yet (a row's page may hold another sequence's
    leftovers), None (the kernels' own zero start) when no sequence has context."""
    if bool((rows >= 0).all()):
        return CacheRows(conv_cache, rows, has_context), CacheRows(rec_cache, rows, has_context)
    return tuple(gather_rows(c, rows.remainder(c.shape[0]), has_context) for c in (conv_cache, rec_cache))


def store_states(conv_cache: torch.Tensor, rec_cache: torch.Tensor, rows: torch.Tensor,
                 conv_state: torch.Tensor | CacheRows, rec_state: torch.Tensor | CacheRows) -> None:
    """An engine's `LinearState.store`: each sequence's final states to its cache rows (whole
    rows, one copy each), none for padding rows (< 0: no page); states the kernels updated in
    place (CacheRows) are already there."""
    ok = rows >= 0
    for cache, state in ((conv_cache, conv_state), (rec_cache, rec_state)):
        if isinstance(state, CacheRows):
            continue
        if bool(ok.all()):
            cache.index_copy_(0, rows, state.to(cache.dtype))
        else:
            cache[rows[ok]] = state[ok].to(cache.dtype)


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
    def __init__(self, cfg: GdnConfig, layer_idx: int, ops: Ops):
        super().__init__()
        self.layer_idx, self.ops = layer_idx, ops
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.r = self.hv // self.hk
        e = cfg.hidden_size
        self.make_projections(cfg, ops)  # first: the parameters' order (state dict, init) is HF's
        self.conv1d = CausalConv1d(cfg.linear_conv_dim, cfg.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, ops)
        self.out_proj = Linear(self.hv * self.dv, e, ops, "row", "linear_attention")

    def make_projections(self, cfg: GdnConfig, ops: Ops) -> None:
        """Qwen3-Next's grouped input projections: in_proj_qkvz / in_proj_ba hold each key
        head's q, k, v, z / b, a together."""
        e = cfg.hidden_size
        self.in_proj_qkvz = Linear(e, cfg.linear_qkvz_dim, ops, "col", "linear_attention")
        # the gates (beta, decay) stay high precision: their error compounds along the recurrence
        self.in_proj_ba = Linear(e, 2 * self.hv, ops, "col")

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
        ops = self.ops
        y, conv1 = ops.causal_conv1d(mixed, conv_w, cu, conv0)
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


class Qwen35GatedDeltaNet(GatedDeltaNet):
    """The GDN layer with Qwen3.5's unfused projections: in_proj_qkv gives q | k | v of all
    heads in the conv's channel order, in_proj_z / in_proj_b / in_proj_a the gate, beta and
    decay inputs per value head (Qwen3.5, Qwen3.5-MoE). The rest is GatedDeltaNet's."""

    def make_projections(self, cfg: GdnConfig, ops: Ops) -> None:
        e = cfg.hidden_size
        self.in_proj_qkv = Linear(e, cfg.linear_conv_dim, ops, "col", "linear_attention")
        self.in_proj_z = Linear(e, self.hv * self.dv, ops, "col", "linear_attention")
        # the gates (beta, decay) stay high precision: their error compounds along the recurrence
        self.in_proj_b = Linear(e, self.hv, ops, "col")
        self.in_proj_a = Linear(e, self.hv, ops, "col")

    def project(self, x):
        return self.project_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def qkv_parts(self, w: torch.Tensor) -> list[torch.Tensor]:
        """in_proj_qkv's weight `w` cut into its q, k and v rows (of the heads this layer
        computes)."""
        qk = self.hk * self.dk
        return list(w.split([qk, qk, self.hv * self.dv]))

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """q | k | v of all heads. With tp_leaves = L > 0 the q, k and v rows are each L
        column blocks (not in_proj_qkv's rows as one run of L blocks): a tensor-parallel
        rank's heads are a block range of each of the three, so it computes whole blocks
        of the same widths (UnfusedGdnHeads.project_qkv) and gets these bits."""
        lin = self.in_proj_qkv
        if not self.ops.tp_leaves:
            return lin(x)
        x, col = lin.operand_input(x), self.ops.linear_for("col")
        return torch.cat([col(x, w) for w in self.qkv_parts(lin.operand_weight())], -1)


class HybridDecoderLayer(nn.Module):
    """The dense decoder layer with the token mixer chosen by the layer index. The Qwen3-Next
    family's layers are this one with other parts (class attributes; `mlp`: a routed block)."""

    attention_cls: type = Attention
    gdn_cls: type = GatedDeltaNet
    norm_offset = False

    def __init__(self, cfg: GdnConfig, layer_idx: int, ops: Ops, mlp: nn.Module | None = None):
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


class HybridCausalLM(CausalLM):
    """The dense causal LM (construction, logits, the trainer's forward) over hybrid layers,
    with the GDN state passed down the layers; each hybrid architecture subclasses it."""

    make_layer = HybridDecoderLayer

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "HybridCausalLM":
        """The dense init, then GDN-specific values: A = exp(A_log) ~ U(1, 16) and dt_bias =
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

