"""GLM-5's tensor-parallel plan: each rank computes its share of MLA's heads; the latent rows,
the indexer and the router stay replicated.

MLA: q_b_proj is split by output rows (a rank's heads' queries), kv_b_proj likewise (a rank's
heads' W_uk / W_uv, read per head, never called), o_proj by input columns (Megatron's layout,
as the dense attention). q_a_proj, kv_a_proj_with_mqa and their norms compute the latent rows
every head reads, so they stay whole on every rank, which computes the same rows.
What MLA adds to the dense plan: every head reads the same latent rows, so their gradient
is a sum over all heads, across ranks. With tp_leaves > 0 each head's part is computed alone
and the ranks' parts are gathered and added by one fixed tree over heads (Ops.
sparse_attention_heads), the tree the model file uses in one process; the indexer loss's
target (the attention summed over heads) gathers the heads' probabilities the same way.
So TP needs tp_leaves > 0 here (the start-up checks require it of the trainer and the engine).

The indexer stays whole: its heads are summed into one score per key before the top-k, so a
split would need that sum across ranks in the forward; replicated, every rank picks the same
keys from the same scores. The router and the MoE follow the Qwen MoE plan: every expert and
the shared experts split like the dense MLP (layers `mlp_layer_types = "dense"` too).
"""

from __future__ import annotations

from functools import partial

import torch.distributed as dist
from torch import nn

from titan_rl.models.common.parallelize import EXPERTS, MLP
from titan_rl.parallel.plan import TPPlan, local, reclass
from titan_rl.parallel.tp_linear import gather_rows


class MlaHeads(nn.Module):
    """Re-classing mixin for MLAttention under TP: h is the rank's head count, kv_b_proj's
    weight the rank's heads' rows."""

    def per_head(self):
        # never the engine's prepared copies: at TP the engine has tp_leaves > 0, which prepares none
        return self.split_heads(local(self.kv_b_proj.weight))


def shard_mla_heads(attn: nn.Module, group) -> None:
    """Make an MLAttention compute this TP rank's heads (its projections are split by the plan)."""
    if not attn.ops.tp_leaves:
        raise ValueError("GLM-5 at TP > 1 needs model.tp_leaves > 0: the heads' parts of the latent rows' gradient "
                         "are added by the fixed tree over heads (an all-reduce would make them close, not bitwise)")
    reclass(attn, MlaHeads)
    attn.heads_gather = partial(gather_rows, group=group)
    attn.h //= dist.get_world_size(group)


MLA = {"self_attn.q_b_proj": "colwise", "self_attn.kv_b_proj": "colwise", "self_attn.o_proj": "rowwise"}
# the routed MoE layers' shared experts (one MLP of moe_intermediate_size x n_shared_experts)
SHARED_EXPERTS = {"mlp.shared_experts.gate_proj": "colwise", "mlp.shared_experts.up_proj": "colwise",
                  "mlp.shared_experts.down_proj": "rowwise"}

TP_PLAN = TPPlan(layer={**MLA, **MLP, **EXPERTS, **SHARED_EXPERTS}, heads={"self_attn": shard_mla_heads},
                 divides=("num_attention_heads",))
