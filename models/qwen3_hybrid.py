"""Qwen3 hybrid: gated delta-rule linear attention (GDN) interleaved with full attention.

Layer i is a full-attention layer when (i + 1) % full_attention_interval == 0 (3 GDN : 1
attention for the default interval 4, as in Qwen3-Next / Qwen3.5), a GDN layer otherwise.
Every layer keeps qwen3's residual structure, RMSNorms and MLP; the full-attention layers
ARE qwen3's Attention (imported from models/qwen3.py, like RMSNorm, Linear, the LM head
path, init_weights and the trainer's forward); every op that depends on the kernel mode
is an `Ops` attribute (models/ops.py), GDN's included.

GDN layer (names as in Qwen3-Next, `model.layers.N.linear_attn.*`):
  in_proj_qkvz [T, E] -> per key head h (Qwen3-Next's grouped layout):
                         q_h [dk], k_h [dk], v_h [r*dv], z_h [r*dv]   (r = Hv / Hk)
  in_proj_ba           -> per key head h: b_h [r], a_h [r]
  conv1d               depthwise causal conv (kernel K) over [q | k | v] (all heads), + silu
  q, k                 L2-normalised per head; the recurrence scales q by dk^-0.5
  g    = -exp(A_log) * softplus(a + dt_bias)       (fp32 log-decay per value head)
  beta = sigmoid(b)                                  (fp32)
  S_t  = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'_{t-1}^T k_t))^T,  o_t = S_t^T q_t  (delta rule)
  norm (gated RMSNorm): rmsnorm(o) * silu(z);  out_proj
Every transcendental runs through ops.gdn_elementwise (kernels.gdn.lane_stable in exact
mode): those tensors' sizes depend on the batch, and ATen computes a buffer's tail with
the scalar function and its body with SIMD, which can differ by an ulp.
Differences from Qwen3-Next checkpoints: the full-attention layers are plain qwen3
attention (no output gate, full rotary), RMSNorm weights are w (not 1 + w), dense MLP.

One flat token stream, the state supplied by the engine
-------------------------------------------------------
Like qwen3, the model computes on ONE flat stream of tokens. Attention is the engine's
callable; the GDN layers' row-mixing (conv and recurrence over a sequence) needs to know
where sequences start and what state they carry in. The engine passes a `LinearState`:

  state.cu_seqlens            int64 [N + 1]: sequence i is rows cu[i]:cu[i+1]; rows from
                              cu[N] on are padding (GDN output 0 there)
  state.initial(layer_idx) -> (conv_state [N, C, K-1] fp32 | None,
                               rec_state  [N, Hv, dk, dv] fp32 | None)   None = zeros
  state.store(layer_idx, conv_state, rec_state)      the states after each sequence

`FreshState` (no state in, nothing stored) is what the trainer uses: `hidden_states`
without a state derives it from `positions` (a new sequence starts at every position 0),
so the trainer's forward(tokens [B, L]) gets cu_seqlens = 0, L, 2L, ... and zero states.
The rollout engine (titan_rl/vllm/hybrid.py) reads/writes vLLM's recurrent-state cache.
The kernels make prefill + decode equal one pass and a batched sequence equal itself
alone, so both engines give each token the same bits.

`kernels="stock"`: plain torch (F.linear, elementwise ops without lane_stable, a plain
L2 norm) and the chunkwise-parallel `gdn_chunked` (GEMMs, not bitwise equal to the
recurrent form); the causal conv stays the kernels' (already plain elementwise torch).

Tensor parallelism: `tp_leaves = L > 0` computes in_proj_qkvz / in_proj_ba as L column
blocks and out_proj as L K-leaves, like qwen3's linears. Both projections are laid out
per key head and out_proj reads the value heads in order, so a TP rank holding whole key
heads holds contiguous rows of them and a contiguous K-share of out_proj
(titan_rl/titan/parallelize.py); every other GDN op is per head and elementwise.
`head_params()` is the one place the layer reads its per-head parameters, so a TP rank
can give it its own heads' share.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from titan_rl.kernels.gdn import causal_conv1d
from titan_rl.kernels.mode import KernelMode
from titan_rl.models.ops import Ops
from titan_rl.models.qwen3 import (
    MLP,
    Attention,
    AttentionFn,
    Linear,
    Qwen3Config,
    Qwen3ForCausalLM,
    RMSNorm,
    resolve_config,
)

# The GDN kernel reduces over dk with a power-of-two halving tree (other sizes are padded)
# and keeps a [dk, dv] fp32 state per head and sequence: powers of two up to 256.
SUPPORTED_LINEAR_HEAD_DIMS = (16, 32, 64, 128, 256)
MODEL_TYPE = "qwen3"  # config.json parses as transformers' Qwen3Config; GDN keys become attributes


@dataclass(frozen=True)
class Qwen3HybridConfig(Qwen3Config):
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4

    # -- layout ----------------------------------------------------------------------------
    def is_full_attention(self, layer_idx: int) -> bool:
        return (layer_idx + 1) % self.full_attention_interval == 0

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if self.is_full_attention(i) else "linear_attention"
                for i in range(self.num_hidden_layers)]

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the conv (and of its state): q, k and v of all heads."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_qkvz_dim(self) -> int:
        """Output width of in_proj_qkvz: q, k, v and z of all heads."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            2 * self.linear_num_value_heads * self.linear_value_head_dim

    def linear_state_shapes(self, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per-sequence state of one GDN layer: conv [C, K-1], recurrent [Hv, dk, dv] (both
        fp32); `tp` > 1: one tensor-parallel rank's share (its heads' channels and heads)."""
        return ((self.linear_conv_dim // tp, self.linear_conv_kernel_dim - 1),
                (self.linear_num_value_heads // tp, self.linear_key_head_dim, self.linear_value_head_dim))

    def validate(self) -> "Qwen3HybridConfig":
        super().validate()
        positive = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "num_hidden_layers")
        for key in positive:
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
        n, k = self.num_hidden_layers, self.full_attention_interval
        if not 2 <= k <= n:
            raise ValueError(
                f"model.full_attention_interval = {k} must be in 2..num_hidden_layers ({n}): the hybrid needs "
                "at least one GDN layer and one full-attention layer (layer i is full attention when "
                "(i + 1) % full_attention_interval == 0)")
        L = self.tp_leaves
        if L:
            widths = {
                "in_proj_qkvz (2*linear_num_key_heads*linear_key_head_dim + "
                "2*linear_num_value_heads*linear_value_head_dim)": self.linear_qkvz_dim,
                "in_proj_ba (2*linear_num_value_heads)": 2 * hv,
                "linear_num_value_heads*linear_value_head_dim": hv * self.linear_value_head_dim,
            }
            for name, n in widths.items():
                if n % L:
                    raise ValueError(f"model.tp_leaves = {L} must divide {name} = {n}")
        return self

    # -- config.json -------------------------------------------------------------------------
    def hf_config(self, architecture: str = "TitanQwen3HybridForCausalLM", dtype: str = "bfloat16") -> dict:
        d = super().hf_config(architecture, dtype)
        d.update(
            model_type=MODEL_TYPE,
            layer_types=self.layer_types,  # vLLM counts attention / linear_attention layers from it
            linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            full_attention_interval=self.full_attention_interval,
        )
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3HybridConfig":
        missing = [f.name for f in fields(cls) if f.name.startswith("linear_") and f.name not in d]
        if "full_attention_interval" not in d:
            missing.append("full_attention_interval")
        if missing:
            raise ValueError(f"config.json lacks the hybrid keys {missing} (not a qwen3_hybrid checkpoint?)")
        base = asdict(Qwen3Config.from_hf(d))
        cfg = cls(**base, **{f.name: int(d[f.name]) for f in fields(cls)
                             if f.name.startswith("linear_") or f.name == "full_attention_interval"}).validate()
        if "layer_types" in d and list(d["layer_types"]) != cfg.layer_types:
            raise ValueError(f"config.json layer_types = {d['layer_types']} disagrees with full_attention_interval "
                             f"= {cfg.full_attention_interval} (expected {cfg.layer_types})")
        return cfg


FLAVORS: dict[str, Qwen3HybridConfig] = {
    # ~3.9M parameters: layers 0-2 GDN, layer 3 full attention. Trains in seconds on CPU.
    "debug_hybrid": Qwen3HybridConfig(),
    # ~50M parameters (10 layers: 8 GDN, 2 full attention): benchmarks.
    "small_hybrid": Qwen3HybridConfig(
        vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    ),
}


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
        return (y.float() * self.ops.gdn_elementwise(F.silu, z.float())).to(x.dtype)


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

    def forward(self, x, state: LinearState):
        T = x.shape[0]
        hk, hv, dk, dv, r = self.hk, self.hv, self.dk, self.dv, self.r
        cu = state.cu_seqlens
        n = int(cu[-1])
        qkvz = self.in_proj_qkvz(x[:n]).view(n, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x[:n]).view(n, hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, hk * dk), k.reshape(n, hk * dk), v.reshape(n, hv * dv)], dim=-1)

        conv_w, A_log, dt_bias, norm_w = self.head_params()
        conv0, rec0 = state.initial(self.layer_idx)
        y, conv1 = causal_conv1d(mixed, conv_w, cu, conv0)
        ops = self.ops
        y = ops.gdn_elementwise(F.silu, y).to(mixed.dtype)  # lane_stable computes in fp32
        q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = ops.gdn_l2norm(q.reshape(n, hk, dk))
        k = ops.gdn_l2norm(k.reshape(n, hk, dk))
        v = v.reshape(n, hv, dv)
        beta = ops.gdn_elementwise(torch.sigmoid, b.reshape(n, hv).float())
        decay = ops.gdn_elementwise(torch.exp, A_log.float())
        g = -decay * ops.gdn_elementwise(F.softplus, a.reshape(n, hv).float() + dt_bias.float())
        o, rec1 = ops.gdn_recurrence(q, k, v, g, beta, cu, rec0, scale=1.0 / math.sqrt(dk))
        state.store(self.layer_idx, conv1, rec1)

        o = self.norm(o, z.reshape(n, hv, dv), norm_w)
        out = self.out_proj(o.reshape(n, hv * dv))
        if n < T:  # padding rows of the engine's stream
            out = torch.cat([out, out.new_zeros(T - n, out.shape[1])])
        return out


class HybridDecoderLayer(nn.Module):
    """qwen3's decoder layer with the token mixer chosen by the layer index."""

    def __init__(self, cfg: Qwen3HybridConfig, layer_idx: int, ops: Ops):
        super().__init__()
        self.is_full_attention = cfg.is_full_attention(layer_idx)
        if self.is_full_attention:
            self.self_attn = Attention(cfg, layer_idx, ops)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, ops)
        self.mlp = MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

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


def build(flavor: str | Qwen3HybridConfig, kernels: KernelMode = "exact", **overrides) -> Qwen3HybridForCausalLM:
    cfg = resolve_config(flavor, FLAVORS, "qwen3_hybrid", Qwen3HybridConfig, **overrides)
    return Qwen3HybridForCausalLM(cfg, kernels)

