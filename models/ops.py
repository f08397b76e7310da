"""Ops: every function of the models whose arithmetic depends on the kernel mode.

The model files call `ops.linear`, `ops.rms_norm`, `ops.causal_attention`, `ops.lm_head`,
`ops.gdn_recurrence`, ... and never look at the mode themselves: the table is chosen once,
here, so "exact" cannot reach a stock function on some path (or the reverse).

exact: titan_rl.kernels (batch-invariant; the rollout engine computes the same bits): the
dispatched ops of kernels/dispatch.py, which run the CPU or the Triton implementation by
the device of their inputs, so a model moved to CUDA needs no other Ops.
stock: plain torch (F.linear, SDPA, ATen elementwise ops, the chunkwise GDN form), for
measuring what exactness costs and what it removes.

Quantization (docs/quantization.md) plugs in here too: `recipe_for(group)` is the recipe a
decoder linear of that layer group runs (exact mode only: a stock trainer is the plain
high-precision one, the stock engine vLLM's own quantization). The Linear of that group
then multiplies fake-quantized operands (trainer) or its held payload, dequantized, by
the same quantized input (engine): kernels.quant's one function per recipe on both sides.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_rl.kernels import (attention_dense, causal_conv1d, gdn_l2norm, gdn_recurrent, index_topk, layer_norm,
                              linear, linear_k_leaves, linear_n_blocks, lm_head_logits, rms_norm, rms_norm_heads,
                              silu_mul, sparse_mla_attention, tree_sum)
from titan_rl.kernels import rope as rope_exact
from titan_rl.kernels.autograd import split_last
from titan_rl.kernels.gdn import causal_conv1d_torch, gdn_chunked, lane_stable
from titan_rl.kernels.indexer.torch_impl import key_rows
from titan_rl.kernels.layernorm.torch_impl import layer_norm_eager
from titan_rl.kernels.moe.torch_impl import topk_ties_low
from titan_rl.kernels.quant.recipes import QuantLayer, QuantRecipe
from titan_rl.kernels.rmsnorm.torch_impl import rms_norm_eager
from titan_rl.kernels.sparse_attention.torch_impl import sparse_attention_eager, sparse_attention_heads
from titan_rl.models.options import ModelOptions


class Ops:
    """The mode-dependent functions for one kernel mode (a KernelMode, checked by the
    caller: config reading and the models' constructor).

    `linear_for(kind)`: the linear of a layer of that kind. "col" (column-parallel under
    TP) and "row" (row-parallel) use the fixed pieces when tp_leaves > 0 (exact mode;
    stock ignores tp_leaves); "plain" (LM head) always uses `linear`.

    causal_attention(q [B, L, H, D], k/v [B, L, Hkv, D], scale) -> [B, L, H, D]: the
    trainer's dense causal attention (every sequence starts at position 0).
    lm_head(hidden, weight) -> fp32 logits (weight in the model's dtype: exact products, fp32
    accumulation; kernels/lm_head).
    head_rms_norm(x [..., H, D], weight [D], eps): the per-head RMSNorm (q_norm / k_norm,
    GDN's gated norm).
    elementwise(fn, x): a transcendental (silu, sigmoid, exp, softplus: GDN's, the output
    and shared-expert gates) of an input whose size depends on the batch, in fp32;
    causal_conv1d(x, weight, cu_seqlens, initial_state) -> (y, final state): GDN's conv (both modes
    the same arithmetic; stock in plain torch ops, exact compiled on CPU);
    gdn_l2norm(x) -> fp32 per-head L2 norm;
    gdn_recurrence(q, k, v, g, beta, cu_seqlens, initial_state, scale=) -> (o, final state).
    DeepSeek sparse attention (GLM-5; kernels/indexer, kernels/sparse_attention, docs/glm5.md):
    index_topk(q, weights, cache, block_table, row_seq, row_pos, key_off, scale, topk) -> each
    row's selected positions [T, topk] (-1 padded); sparse_attention(q, cache, block_table,
    row_seq, indices, scale, dv) -> [T, H, dv]; layer_norm(x, weight, bias, eps);
    expert_topk(scores, k) -> ids [T, k] (exact: ties to the lowest index; stock: torch.topk)."""

    def __init__(self, options: ModelOptions):
        self.options = options.validate()
        self.kernels = options.kernels
        exact = options.kernels == "exact"
        for name, (exact_fn, stock_fn) in MODE_OPS.items():
            setattr(self, name, exact_fn if exact else stock_fn)
        q = options.quantization
        self.quant_recipe: QuantRecipe = q.recipe if exact else "none"
        self.quant_layers = tuple(q.layers) if self.quant_recipe != "none" else ()
        self.tp_leaves = options.tp_leaves if exact else 0
        # One GEMM over concatenated weights (same_input) is a choice of the exact kernels.
        self.fuse_same_input = exact

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, gather=None) -> torch.Tensor:
        """RMSNorm of per-head vectors by a weight shared by the heads. With the TP pieces its
        weight gradient is a fixed tree over heads (kernels.rms_norm_heads), the same bits
        whatever number of heads a call holds; `gather` joins the TP ranks' heads."""
        if self.tp_leaves:
            return rms_norm_heads(x, weight, eps, gather)
        if gather is not None:
            raise ValueError("head_rms_norm: gather needs tp_leaves > 0")
        return self.rms_norm(x, weight, eps)

    def sparse_attention_heads(self, q, cache, block_table, row_seq, indices, scale: float, dv: int,
                               gather=None) -> torch.Tensor:
        """sparse_attention (the same forward bits). With the TP pieces its backward gives a
        head's bits whatever number of heads a call holds, and the cache's gradient (a sum
        over heads: MLA's heads share the latent rows) a fixed tree over heads
        (kernels/sparse_attention: sparse_attention_heads); `gather` joins the TP ranks' heads."""
        if self.tp_leaves:
            return sparse_attention_heads(q, cache, block_table, row_seq, indices, scale, dv, self.sparse_attention,
                                          tree_sum, gather)
        if gather is not None:
            raise ValueError("sparse_attention_heads: gather needs tp_leaves > 0")
        return self.sparse_attention(q, cache, block_table, row_seq, indices, scale, dv)

    def partial_rope(self, x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
        """RoPE on the first `rotary_dim` of each head's `d` channels, the rest passed through
        (Qwen3-Next / Qwen3.5's partial rotary; rotary_dim == d is plain RoPE)."""
        if rotary_dim == x.shape[-1]:
            return self.rope(x, positions, theta)
        return torch.cat([self.rope(x[..., :rotary_dim].contiguous(), positions, theta), x[..., rotary_dim:]], -1)

    def recipe_for(self, group: QuantLayer | None) -> QuantRecipe | None:
        """The recipe a linear of layer group `group` runs; None: high precision (no group:
        LM head, router, GDN gates; or a group the config leaves out)."""
        return self.quant_recipe if group in self.quant_layers else None

    def linear_for(self, kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        L = self.tp_leaves
        if kind == "col" and L:
            return partial(linear_n_blocks, n_blocks=L)
        if kind == "row" and L:
            return partial(linear_k_leaves, k_leaves=L)
        return self.linear

    def same_input(self, x: torch.Tensor, mods: list) -> list[torch.Tensor]:
        """mods' outputs on x (q/k/v, gate/up). Exact mode without TP pieces runs them as
        ONE GEMM over the concatenated weights (fewer, larger calls; the trainer
        concatenates per call, the engine reads the same weights prepared once:
        kernels/linear_forms.py fused_linear); both sides take this path, so both get its bits."""
        if not self.fuse_same_input or self.tp_leaves or any(isinstance(m.weight, DTensor) for m in mods):
            return [m(x) for m in mods]
        from titan_rl.kernels.linear_forms import fused_linear

        return split_last(fused_linear(x, mods, self.linear), [m.out_rows for m in mods])


# -- the stock functions (plain torch) ------------------------------------------------------

def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (HF semantics: cos/sin in fp32, cast to x's dtype), plain torch:
    the stock mode's. Exact mode uses kernels.elementwise.rope (same formula, cos/sin
    from a table whose bits do not depend on the call's size)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=x.device).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=True, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    ).transpose(1, 2)


def _linear_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden.float(), weight.float())


def _plain(fn, x):
    return fn(x)


def _plain_l2norm(x, eps: float = 1e-6):
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)


def _torch_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk's indices, unsorted: which of tied entries it returns is its own business."""
    return torch.topk(scores, k, dim=-1, sorted=False).indices


def _index_topk_stock(q, weights, cache, block_table, row_seq, row_pos, key_off: int, scale: float, topk: int):
    """The indexer in plain torch, as transformers computes it: per sequence one fp32 matmul of
    the rows' queries with its keys, relu, the head-weighted sum, causal mask, torch.topk
    (positions in its own order, not ascending; among ties whichever it returns), -1 padded."""
    T, H, D = q.shape
    out = torch.full((T, topk), -1, dtype=torch.long, device=q.device)
    for s in row_seq.unique().tolist():
        rows = (row_seq == s).nonzero().flatten()
        pos = row_pos[rows].long()
        n = int(pos.max()) + 1
        keys = key_rows(cache, block_table, int(s), n)[:, key_off:key_off + D].float()
        scores = torch.relu(torch.matmul(q[rows].float(), keys.t()) * scale)  # [r, H, n]
        index = torch.matmul(weights[rows].float().unsqueeze(-2), scores).squeeze(-2)  # [r, n]
        index = index.masked_fill(torch.arange(n, device=q.device)[None, :] > pos[:, None], float("-inf"))
        k = min(topk, n)
        sel = index.topk(k, dim=-1).indices
        out[rows, :k] = torch.where(sel <= pos[:, None], sel, -1)  # masked picks: rows with fewer than k positions
    return out


# The one list of mode-dependent ops: name -> (exact, stock). Ops binds each as an
# attribute; the execution contract names what each resolves to (titan_rl/contract.py).
MODE_OPS: dict[str, tuple[Callable, Callable]] = {
    "linear": (linear, F.linear),
    "rms_norm": (rms_norm, rms_norm_eager),
    "silu_mul": (silu_mul, _silu_mul),
    "rope": (rope_exact, rope),
    "causal_attention": (attention_dense, _sdpa_causal),
    "lm_head": (lm_head_logits, _linear_fp32),
    "elementwise": (lane_stable, _plain),
    "causal_conv1d": (causal_conv1d, causal_conv1d_torch),
    "gdn_l2norm": (gdn_l2norm, _plain_l2norm),
    "gdn_recurrence": (gdn_recurrent, gdn_chunked),
    "index_topk": (index_topk, _index_topk_stock),
    "sparse_attention": (sparse_mla_attention, sparse_attention_eager),
    "layer_norm": (layer_norm, layer_norm_eager),
    "expert_topk": (topk_ties_low, _torch_topk),
}
