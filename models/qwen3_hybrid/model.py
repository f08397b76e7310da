"""The Qwen3 GDN hybrid: gated delta-rule linear attention (GDN) layers with Qwen3-Next's
grouped projections, interleaved with the dense decoder's full attention (layer i is full
attention when (i + 1) % full_attention_interval == 0), each followed by the dense SwiGLU MLP.
All of it is models/common/gdn.py's HybridCausalLM as it is; docs/gdn.md explains the layer."""

from __future__ import annotations

from titan_rl.models.common.gdn import HybridCausalLM


class Qwen3HybridForCausalLM(HybridCausalLM):
    pass
