"""The dense decoder's tensor-parallel plan (data) and its attention-head hook.

q/k/v and gate/up are split by output rows, o and down by input columns (Megatron's
layout); each rank's attention computes its own heads. The embedding, the final norm and
the LM head stay replicated. q_norm / k_norm normalise only the rank's heads with a weight
shared by all heads: with tp_leaves > 0 its weight gradient is the one-process model's
fixed tree over all heads' partials (the ranks' heads gathered: kernels.rms_norm_heads),
else the weight passes through copy_to_tp (identity forward, all-reduce backward).
"""

from __future__ import annotations

from functools import partial

import torch.distributed as dist
from torch import nn

from titan_rl.parallel.plan import TPPlan, reclass
from titan_rl.parallel.tp_linear import copy_to_tp, gather_rows


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
