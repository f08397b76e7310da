"""Qwen3.5 (text), read top to bottom: Qwen3-Next's layers (models/qwen3_next/model.py) with
a dense MLP and the GDN projections unfused: in_proj_qkv gives q | k | v of all heads in
the conv's channel order, in_proj_z / in_proj_b / in_proj_a the gate, beta and decay inputs
per value head. The rest of the GDN layer is the hybrid's (models/qwen3_hybrid/model.py).
"""

from __future__ import annotations

import torch

from titan_rl.models.layers import Linear
from titan_rl.models.ops import Ops
from titan_rl.models.qwen3_hybrid.model import CausalConv1d, GatedDeltaNet, GatedRMSNorm, Qwen3HybridForCausalLM
from titan_rl.models.qwen3_next.model import NextDecoderLayer
from titan_rl.models.qwen3_5.config import Qwen35Config


class Qwen35GatedDeltaNet(GatedDeltaNet):
    def __init__(self, cfg: Qwen35Config, layer_idx: int, ops: Ops):
        torch.nn.Module.__init__(self)
        self.layer_idx, self.ops = layer_idx, ops
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.r = self.hv // self.hk
        e = cfg.hidden_size
        self.in_proj_qkv = Linear(e, cfg.linear_conv_dim, ops, "col", "linear_attention")
        self.in_proj_z = Linear(e, self.hv * self.dv, ops, "col", "linear_attention")
        # the gates (beta, decay) stay high precision: their error compounds along the recurrence
        self.in_proj_b = Linear(e, self.hv, ops, "col")
        self.in_proj_a = Linear(e, self.hv, ops, "col")
        self.conv1d = CausalConv1d(cfg.linear_conv_dim, cfg.linear_conv_kernel_dim)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.hv))
        self.A_log = torch.nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, ops)
        self.out_proj = Linear(self.hv * self.dv, e, ops, "row", "linear_attention")

    def project(self, x):
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)


class Qwen35DecoderLayer(NextDecoderLayer):
    gdn_cls = Qwen35GatedDeltaNet


class Qwen35ForCausalLM(Qwen3HybridForCausalLM):
    make_layer = Qwen35DecoderLayer
    norm_offset = True
