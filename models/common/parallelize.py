"""The tensor-parallel plan pieces every architecture's plan is made of (data) and the
head hooks: the dense decoder's attention and MLP, the experts of a routed MLP, and the
GDN layers of the hybrids.

q/k/v and gate/up are split by output rows, o and down by input columns (Megatron's
layout); each rank's attention computes its own heads. The embedding, the final norm and
the LM head stay replicated. q_norm / k_norm normalise only the rank's heads with a weight
shared by all heads: with tp_leaves > 0 its weight gradient is the one-process model's
fixed tree over all heads' partials (the ranks' heads gathered: kernels.rms_norm_heads),
else the weight passes through copy_to_tp (identity forward, all-reduce backward).

Experts: every expert's MLP is split like the dense one (each rank computes its slice of
every expert: no expert parallelism); the router stays replicated, so every rank routes the
same tokens identically.

GDN layers are split by whole key heads. in_proj_qkvz / in_proj_ba are laid out per key
head, so splitting them by output rows gives each rank whole key heads and their value
heads; out_proj reads the value heads in order, so it is split by input columns. Conv,
gates, L2 norms and the recurrence are per head and elementwise: a head's bits do not
depend on how many heads a call holds. The small per-head parameters (conv weight, A_log,
dt_bias) stay replicated and each rank takes its heads' slice through copy_to_tp (identity
forward, all-reduce of the ranks' gradients, zero outside their heads: the sum is exact).
The gated norm's weight is shared by all heads: the q_norm rule above (a fixed tree over
heads with tp_leaves > 0). Qwen3.5's unfused projections: in_proj_z / b / a are per value
head (split by output rows); in_proj_qkv holds q, then k, then v of all heads, so it stays
whole and each rank computes its heads' three row ranges (UnfusedGdnHeads).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from titan_rl.parallel.plan import TPPlan, reclass
from titan_rl.parallel.tp_linear import column_parallel_linear, copy_to_tp, gather_rows


class HeadNorm(nn.Module):
    """Re-classing mixin for q_norm / k_norm under TP."""

    tp_group = None

    def forward(self, x):
        if self.ops.tp_leaves:
            y = self.ops.head_rms_norm(*self.operands(x, self.weight), self.eps, partial(gather_rows, group=self.tp_group))
        else:
            y = self.ops.head_rms_norm(*self.operands(x, copy_to_tp(self.weight, self.tp_group)), self.eps)
        return y.to(x.dtype)


def shard_attention_heads(attn: nn.Module, group) -> None:
    """Make an Attention compute this TP rank's heads (its projections are split by the plan)."""
    tp = dist.get_world_size(group)
    for norm in (attn.q_norm, attn.k_norm):
        if norm is None:  # no q/k norm (Llama)
            continue
        reclass(norm, HeadNorm)
        norm.tp_group = group
    attn.h, attn.hkv = attn.h // tp, attn.hkv // tp


ATTENTION = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
             "self_attn.o_proj": "rowwise"}
MLP = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")

DENSE_TP_PLAN = TPPlan(layer={**ATTENTION, **MLP}, heads={"self_attn": shard_attention_heads}, divides=HEAD_COUNTS)

EXPERTS = {"mlp.experts.*.gate_proj": "colwise", "mlp.experts.*.up_proj": "colwise",
           "mlp.experts.*.down_proj": "rowwise"}
# Qwen3-Next's and Qwen3.5-MoE's shared expert, split like the dense MLP (its one-output gate stays replicated)
SHARED_EXPERT = {"mlp.shared_expert.gate_proj": "colwise", "mlp.shared_expert.up_proj": "colwise",
                 "mlp.shared_expert.down_proj": "rowwise"}


class GdnHeads(nn.Module):
    """Re-classing mixin for a GDN layer under TP: its per-head parameters are this rank's
    share of the replicated conv weight, A_log and dt_bias (`gdn_rank_share`)."""

    tp_group = None
    tp_channels: torch.Tensor | None = None
    tp_value_heads: slice = slice(None)

    def head_params(self):
        g = self.tp_group
        heads = self.tp_value_heads
        norm_w = self.norm.weight if self.norm.tp_gather is not None else copy_to_tp(self.norm.weight, g)
        return (copy_to_tp(self.conv1d.weight, g)[self.tp_channels], copy_to_tp(self.A_log, g)[heads],
                copy_to_tp(self.dt_bias, g)[heads], norm_w)


def gdn_rank_share(hk: int, hv: int, dk: int, dv: int, rank: int, tp: int) -> tuple[torch.Tensor, slice]:
    """TP rank `rank` of `tp`'s share of a GDN layer: (indices of its conv channels in
    the [q | k | v] layout of all heads, its value heads)."""
    hk_r, hv_r = hk // tp, hv // tp
    q = torch.arange(rank * hk_r * dk, (rank + 1) * hk_r * dk)
    v = torch.arange(rank * hv_r * dv, (rank + 1) * hv_r * dv)
    return torch.cat([q, hk * dk + q, 2 * hk * dk + v]), slice(rank * hv_r, (rank + 1) * hv_r)


def shard_gdn_heads(gdn: nn.Module, group) -> None:
    """Make a GDN layer compute this TP rank's key heads and their value heads."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    gdn.tp_channels, gdn.tp_value_heads = gdn_rank_share(gdn.hk, gdn.hv, gdn.dk, gdn.dv, rank, tp)
    reclass(gdn, GdnHeads)
    gdn.tp_group = group
    if gdn.ops.tp_leaves:
        gdn.norm.tp_gather = partial(gather_rows, group=group)
    gdn.hk, gdn.hv = gdn.hk // tp, gdn.hv // tp


GDN = {"linear_attn.in_proj_qkvz": "colwise", "linear_attn.in_proj_ba": "colwise", "linear_attn.out_proj": "rowwise"}
# the hybrids' head hooks and the head counts TP must divide
GDN_HEADS = {"self_attn": shard_attention_heads, "linear_attn": shard_gdn_heads}
GDN_HEAD_COUNTS = (*HEAD_COUNTS, "linear_num_key_heads")


class UnfusedGdnHeads(GdnHeads):
    """Re-classing mixin for Qwen3.5's GDN layer under TP. in_proj_qkv holds q, then k, then
    v of all heads, so a rank's heads are three row ranges of it, not one shard: the weight
    stays whole on every rank (the checkpoint, the HF export and the engine's weight sync
    keep transformers' layout) and each rank computes its three ranges as column-parallel
    pieces (the cost: every rank holds the whole weight, as FSDP alone would). The weight
    passes through copy_to_tp: each rank's gradient is zero outside its rows, so the
    all-reduce sum is exact."""

    tp_qkv_rows: tuple[slice, slice, slice] = (slice(None),) * 3

    def project_qkv(self, x):
        lin, g, L = self.in_proj_qkv, self.tp_group, self.ops.tp_leaves
        w = copy_to_tp(lin.operand_weight(), g)
        x = lin.operand_input(x)
        parts = [w[rows] for rows in self.tp_qkv_rows]
        if L:  # the model file's blocks of q, k and v: this rank's are whole ones
            return torch.cat([column_parallel_linear(x, p, g, L) for p in parts], -1)
        return self.ops.linear(copy_to_tp(x, g), torch.cat(parts))


def shard_unfused_gdn_heads(gdn: nn.Module, group) -> None:
    """Make a Qwen3.5 GDN layer compute this TP rank's key heads and their value heads."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    qk, v = gdn.hk * gdn.dk // tp, gdn.hv * gdn.dv // tp
    rows = (slice(rank * qk, (rank + 1) * qk), slice(tp * qk + rank * qk, tp * qk + (rank + 1) * qk),
            slice(2 * tp * qk + rank * v, 2 * tp * qk + (rank + 1) * v))
    shard_gdn_heads(gdn, group)
    reclass(gdn, UnfusedGdnHeads)
    gdn.tp_qkv_rows = rows


# Qwen3.5's unfused GDN projections: in_proj_z / in_proj_b / in_proj_a are per value head
# (split by output rows); in_proj_qkv stays whole (UnfusedGdnHeads says why).
UNFUSED_GDN = {"linear_attn.in_proj_z": "colwise", "linear_attn.in_proj_b": "colwise",
               "linear_attn.in_proj_a": "colwise", "linear_attn.out_proj": "rowwise"}
UNFUSED_GDN_WHOLE = ("linear_attn.in_proj_qkv",)
UNFUSED_GDN_HEADS = {"self_attn": shard_attention_heads, "linear_attn": shard_unfused_gdn_heads}
