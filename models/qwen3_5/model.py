"""Qwen3.5 (text): Qwen3-Next's layers (models/common/next.py: gated attention, zero-centred
RMSNorms, GDN by `layer_types`) with a dense MLP and the GDN projections unfused
(models/common/gdn.py, Qwen35GatedDeltaNet: in_proj_qkv gives q | k | v of all heads in the
conv's channel order, in_proj_z / in_proj_b / in_proj_a the gate, beta and decay inputs per
value head)."""

from __future__ import annotations

from titan_rl.models.common.gdn import HybridCausalLM
from titan_rl.models.common.next import Qwen35DecoderLayer


class Qwen35ForCausalLM(HybridCausalLM):
    make_layer = Qwen35DecoderLayer
    norm_offset = True
