"""The hybrid's tensor-parallel plan: qwen3's attention and MLP, and the GDN layers split
by whole key heads.

in_proj_qkvz / in_proj_ba are laid out per key head, so splitting them by output rows
gives each rank whole key heads and their value heads; out_proj reads the value heads in
order, so it is split by input columns. Conv, gates, L2 norms and the recurrence are per
head and elementwise: a head's bits do not depend on how many heads a call holds. The
small per-head parameters (conv weight, A_log, dt_bias) stay replicated and each rank
takes its heads' slice through copy_to_tp (identity forward, all-reduce of the ranks'
gradients, zero outside their heads: the sum is exact). The gated norm's weight is
shared by all heads: qwen3's q_norm rule (a fixed tree over heads with tp_leaves > 0).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from titan_rl.models.qwen3.parallelize import ATTENTION, HEAD_COUNTS, MLP, shard_attention_heads
from titan_rl.parallel.plan import TPPlan, reclass
from titan_rl.parallel.tp_linear import copy_to_tp, gather_rows


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

TP_PLAN = TPPlan(layer={**ATTENTION, **GDN, **MLP},
                 heads={"self_attn": shard_attention_heads, "linear_attn": shard_gdn_heads},
                 divides=(*HEAD_COUNTS, "linear_num_key_heads"))
