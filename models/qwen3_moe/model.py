"""Qwen3-MoE decoder: the dense decoder (models/common/transformer.py) with the MLP of every
layer replaced by a routed one (models/common/moe.py: SparseMoeBlock, whose parameter names,
routing and replay are described there).

Everything but the MLP (attention, RoPE, q/k norms, RMSNorm, Linear and its kinds, the
LM head, `hidden_states`/`logits`/`forward`) is the dense decoder's, and the kernel modes
are models/ops.py's `Ops`: imported, not copied, so both engines drive this model exactly
like the dense one. Every layer is sparse (decoder_sparse_step = 1, no mlp_only_layers, no
shared expert: Qwen3-MoE's published models).
"""

from __future__ import annotations

from titan_rl.models.common.moe import MoeConfig, Routed, SparseMoeBlock
from titan_rl.models.common.transformer import CausalLM, DecoderLayer
from titan_rl.models.ops import Ops


def moe_decoder_layer(cfg: MoeConfig, layer_idx: int, ops: Ops) -> DecoderLayer:
    """The dense decoder layer with the routed block in the MLP's place."""
    return DecoderLayer(cfg, layer_idx, ops, mlp=SparseMoeBlock(cfg, ops))


class Qwen3MoeForCausalLM(Routed, CausalLM):
    """The dense causal LM with MoE layers; __init__/hidden_states/logits/forward/
    init_weights are the dense one's (same signatures, same kernels)."""

    make_layer = staticmethod(moe_decoder_layer)
