"""GLM-5 (transformers' GlmMoeDsaForCausalLM), read top to bottom: MLA attention with DeepSeek
sparse attention (the lightning indexer picks each token's keys), a dense MLP in the first
layers and a sigmoid-routed MoE with shared experts after them. docs/glm5.md says why each
piece is computed as it is.

Like the dense decoder (models/common/transformer.py) the model computes on ONE flat token stream. What mixes rows is the per-layer
cache of token rows: each token's row is [c_kv | k_rope | indexer key] (MLA's latent KV and
the indexer's key), and the engine passes a `LatentCache` whose `store(layer, rows)` puts this
forward's rows where the engine keeps them and returns a `KeyView` over everything a row may
read (its sequence's rows 0..pos). The trainer's `DenseLatents` is its own [B, L] batch, one
page per sequence; vLLM's wrapper (titan_rl/vllm/dsa.py) writes into its paged KV cache. Both
then run the same kernels over their view: the indexer's top-k (`ops.index_topk`) and
attention over the selected keys only (`ops.sparse_attention`), whose rows read their own
position's data alone.

MLA runs in the absorbed form in both engines: a head's query is moved into the latent space
(q_nope @ W_uk), attention is an MQA over the cached latent rows (keys [c_kv | k_rope], values
c_kv), and the head's output leaves it through W_uv; nothing is decompressed per key. Per-head
projections go through the invariant `linear`, one call per head.

Parameter names are transformers' (`model.layers.N.self_attn.indexer.wq_b.weight`,
`model.layers.N.mlp.gate.e_score_correction_bias`, `mlp.experts.M.gate_proj.weight`, ...).

Two kinds of choice point (models/common/choice_points.py): each indexer layer's "indices"
(the [T, topk] positions it attends to) and each MoE layer's "routes" (the experts); `used` /
`own` give them per layer after a forward (they differ only under replay) and `force` replays
them. After each forward also: `aux_loss` (0: GLM-5 balances experts with the correction bias,
not a loss) and `indexer_loss` (the indexers' own loss when they are trained, else None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from titan_rl.kernels.indexer.torch_impl import index_log_probs
from titan_rl.kernels.moe import compact_routes, moe_experts, router_sigmoid_topk
from titan_rl.kernels.sparse_attention.torch_impl import attention_target, selected_rows
from titan_rl.models.common.choice_points import ChoicePoint
from titan_rl.models.common.transformer import MLP, Backbone, CausalLM
from titan_rl.kernels.linear_forms import Heads, heads_operand, untouched
from titan_rl.models.layers import Linear, RMSNorm
from titan_rl.models.ops import Ops
from titan_rl.models.options import ModelOptions
from titan_rl.models.glm_moe_dsa.config import GlmDsaConfig


# -- what the engines pass: where this forward's cache rows go, and what a row may read -------

@dataclass
class KeyView:
    """The cache rows a forward's query rows read: `cache` [pages, page, W], the row of
    position p of sequence s at cache[block_table[s, p // page], p % page]; query row r is
    position row_pos[r] of sequence row_seq[r]."""

    cache: torch.Tensor
    block_table: torch.Tensor
    row_seq: torch.Tensor
    row_pos: torch.Tensor


class LatentCache(Protocol):
    def store(self, layer_idx: int, rows: torch.Tensor) -> KeyView: ...


class DenseLatents:
    """The trainer's: B sequences of L tokens, each from position 0; a layer's rows are read
    where they are ([B, L, W], one page per sequence: no copy, so gradients reach them)."""

    def __init__(self, B: int, L: int, device):
        self.B, self.L = B, L
        self.block_table = torch.arange(B, device=device).view(B, 1)
        self.row_seq = torch.arange(B, device=device).repeat_interleave(L)
        self.row_pos = torch.arange(L, device=device).repeat(B)

    def store(self, layer_idx: int, rows: torch.Tensor) -> KeyView:
        return KeyView(rows.view(self.B, self.L, -1), self.block_table, self.row_seq, self.row_pos)


def compact_indices(ind: torch.Tensor, max_positions: int) -> torch.Tensor:
    """Selected positions for storage / transfer: int16 while every position fits, else int32
    (-1 padding either way)."""
    return ind.to(torch.int16 if max_positions <= 32767 else torch.int32)


# -- pieces ---------------------------------------------------------------------------------

def interleaved_rope(ops: Ops, x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """transformers' interleaved RoPE (`apply_rotary_pos_emb_interleave`): channel pairs (x0, x1),
    (x2, x3), ... rotated, the result laid out [even channels | odd channels]. That is rotate-half
    RoPE of the de-interleaved x (a gather: exact), so the same RoPE kernel gives the same bits
    (queries and keys share the layout, so dot products are unchanged)."""
    d = x.shape[-1]
    perm = torch.cat([torch.arange(0, d, 2, device=x.device), torch.arange(1, d, 2, device=x.device)])
    return ops.rope(x.index_select(-1, perm).contiguous(), positions, theta)


class LayerNorm(nn.Module):
    """nn.LayerNorm's parameters (weight, bias) over ops.layer_norm."""

    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x):
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


class Indexer(nn.Module):
    """The lightning indexer (transformers' GlmMoeDsaIndexer): per token Hi query heads from
    the q latent, one key, and per-head weights; score_j = sum_h w_h relu(q_h . k_j / sqrt(Di)).
    Its first qk_rope_head_dim channels carry interleaved RoPE. The policy's loss does not reach
    it (the selection is discrete, and it reads detached inputs); when its parameters take
    gradients (`model.freeze_indexer = false`) it is trained by its own loss
    (`MLAttention.indexer_loss`), else they are frozen (titan_rl/titan/build.py)."""

    def __init__(self, cfg: GlmDsaConfig, ops: Ops):
        super().__init__()
        self.ops, self.h, self.d, self.rope_dim = ops, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.theta = cfg.rope_theta
        self.wq_b = Linear(cfg.q_lora_rank, self.h * self.d, ops)
        self.wk = Linear(cfg.hidden_size, self.d, ops)
        self.k_norm = LayerNorm(self.d, 1e-6, ops)
        self.weights_proj = Linear(cfg.hidden_size, self.h, ops)

    def engine_operands(self, source) -> list:
        """Nothing prepared for weights_proj: `queries` multiplies by its weight in fp32, per call."""
        return untouched(self.weights_proj)

    def _rope_first(self, x, positions):
        r = self.rope_dim
        return torch.cat([interleaved_rope(self.ops, x[..., :r], positions, self.theta), x[..., r:]], -1)

    def key(self, x, positions) -> torch.Tensor:
        """[T, Di] in x's dtype: the token's indexer key (LayerNorm, then RoPE). Callers pass x
        detached: a gradient reaches the indexer's parameters only."""
        k = self.k_norm(self.wk(x))
        return self._rope_first(k.unsqueeze(1), positions).squeeze(1)

    def queries(self, x, q_latent, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, Hi, Di] in x's dtype, head weights fp32 [T, Hi] = weights_proj(x) / sqrt(Hi),
        computed in fp32 as transformers keeps weights_proj). Inputs detached, as `key`'s."""
        T = x.shape[0]
        q = self._rope_first(self.wq_b(q_latent).view(T, self.h, self.d), positions)
        w = self.ops.linear(x.float(), self.weights_proj.weight.float()) * self.h ** -0.5
        return q, w


class MLAttention(nn.Module):
    """Multi-head latent attention with DeepSeek sparse attention (transformers'
    GlmMoeDsaAttention). `indexer` is None on an indexer_types "shared" layer: it attends to
    the previous layer's selection."""

    def __init__(self, cfg: GlmDsaConfig, layer_idx: int, ops: Ops):
        super().__init__()
        self.layer_idx, self.ops = layer_idx, ops
        self.h, self.nope, self.v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.kv_lora, self.theta, self.topk = cfg.kv_lora_rank, cfg.rope_theta, cfg.index_topk
        e = cfg.hidden_size
        self.q_a_proj = Linear(e, cfg.q_lora_rank, ops)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, ops)
        # "col" / "row": split by heads under TP (models/glm_moe_dsa/parallelize.py); kv_b_proj is
        # only read per head (`per_head`), never called
        self.q_b_proj = Linear(cfg.q_lora_rank, self.h * cfg.qk_head_dim, ops, "col")
        self.kv_a_proj_with_mqa = Linear(e, self.kv_lora + self.rope_dim, ops)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, 1e-6, ops)
        self.kv_b_proj = Linear(self.kv_lora, self.h * (self.nope + self.v), ops, "col")
        self.o_proj = Linear(self.h * self.v, e, ops, "row")
        self.indexer = Indexer(cfg, ops) if cfg.indexer_types[layer_idx] == "full" else None
        self.scale = cfg.qk_head_dim ** -0.5
        self.index_scale = cfg.index_head_dim ** -0.5
        # the key positions [T, topk] attended to; a replayed row starting with -1 keeps the indexer's own
        n = cfg.max_position_embeddings
        self.indices = ChoicePoint("indices", lambda ind: compact_indices(ind, n)) if self.indexer is not None else None
        self.indexer_loss: torch.Tensor | None = None
        # TP: joins the ranks' per-head pieces ([h, ...] -> [H, ...]); None: this module holds every head
        self.heads_gather = None

    def per_head(self) -> tuple[list, list]:
        """The absorbed form's per-head weights: the engine's, prepared once per load (kv_b_proj's
        form, kernels/linear_forms.py: Heads), else the trainer's from kv_b_proj (`split_heads`)."""
        form = self.kv_b_proj.form
        if isinstance(form, Heads):
            return form.operand["w_uk_t"], form.operand["w_uv"]
        return self.split_heads(self.kv_b_proj.weight)

    def split_heads(self, kv_b: torch.Tensor) -> tuple[list, list]:
        """kv_b_proj's rows per head are [k_nope (nope) | v (v_head_dim)]: the absorbed form's
        W_uk^T [kv_lora, nope] (query -> latent) and W_uv [v, kv_lora] (latent -> value)."""
        w = kv_b.view(self.h, self.nope + self.v, self.kv_lora)
        return [w[h, : self.nope].t() for h in range(self.h)], [w[h, self.nope:] for h in range(self.h)]

    def forward(self, x, positions, cache: LatentCache, shared: torch.Tensor | None):
        T = x.shape[0]
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(T, self.h, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope], interleaved_rope(self.ops, q[..., self.nope:], positions, self.theta)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, : self.kv_lora])
        k_pe = interleaved_rope(self.ops, kv[:, None, self.kv_lora:], positions, self.theta)[:, 0]
        parts = [c_kv, k_pe]
        if self.indexer is not None:  # detached inputs: the indexer's own loss trains only the indexer
            parts.append(self.indexer.key(x.detach(), positions))
        view = cache.store(self.layer_idx, torch.cat(parts, -1))

        if self.indexer is not None:
            qi, wi = self.indexer.queries(x.detach(), q_latent.detach(), positions)
            own = self.ops.index_topk(qi, wi, view.cache, view.block_table, view.row_seq, view.row_pos,
                                      self.kv_lora + self.rope_dim, self.index_scale, self.topk)
        else:
            own = shared
        used = own
        if self.indexer is not None and self.indices.override is not None:
            forced = self.indices.override.to(device=own.device, dtype=torch.long)
            if tuple(forced.shape) != tuple(own.shape):
                raise ValueError(f"layer {self.layer_idx}: index override has shape {tuple(forced.shape)}, expected "
                                 f"{tuple(own.shape)}")
            used = torch.where(forced[:, :1] >= 0, forced, own)
            # a set may only hold positions the row can see (0..its own), ascending, -1 after them
            order = (used[:, 1:] >= 0) & ((used[:, 1:] <= used[:, :-1]) | (used[:, :-1] < 0))
            bad = ((used > view.row_pos[:, None]) | (used < -1)).any(-1) | order.any(-1)
            if bool(bad.any()):
                r = int(bad.nonzero()[0])
                raise ValueError(f"layer {self.layer_idx}: replayed key set {used[r].tolist()} of position "
                                 f"{int(view.row_pos[r])} is not ascending positions <= {int(view.row_pos[r])}")
        if self.indexer is not None:
            self.indices.record(used, own)

        w_uk_t, w_uv = self.per_head()
        # a head's slice made contiguous: its strides then do not depend on how many heads q holds
        q_lat = torch.stack([self.ops.linear(q_nope[:, h].contiguous(), w_uk_t[h]) for h in range(self.h)], 1)
        q_attn = torch.cat([q_lat, q_pe], -1)
        o_lat = self.ops.sparse_attention_heads(q_attn, view.cache, view.block_table, view.row_seq, used, self.scale,
                                                self.kv_lora, self.heads_gather)
        # qi carries a graph only when the indexer's parameters take gradients (and grad is on)
        trained = self.indexer is not None and qi.requires_grad
        self.indexer_loss = self._indexer_loss(qi, wi, q_attn, view, used) if trained else None
        o = torch.cat([self.ops.linear(o_lat[:, h].contiguous(), w_uv[h]) for h in range(self.h)], -1)
        return self.o_proj(o), used

    def _indexer_loss(self, qi, wi, q_attn, view: KeyView, used) -> torch.Tensor:
        """DeepSeek-V3.2's / GLM-5's indexer loss: per row KL(p || softmax(index scores)) over the
        keys attention read, p = the attention's probabilities summed over heads, L1-normalised
        and detached; the mean over rows. Its gradient reaches the indexer's parameters only
        (its query and weights from detached inputs; its keys, channels of the cache rows, too)."""
        target = attention_target(q_attn.detach(), view.cache, view.block_table, view.row_seq, used, self.scale,
                                  self.heads_gather)
        off = self.kv_lora + self.rope_dim
        keys = selected_rows(view.cache, view.block_table, view.row_seq, used)[..., off:off + self.indexer.d]
        valid = used >= 0
        log_q = index_log_probs(qi, wi, keys, valid, self.index_scale).masked_fill(~valid, 0.0)  # -inf at padding
        return (torch.xlogy(target, target) - target * log_q).sum(-1).mean()

    def engine_operands(self, source) -> list:
        """The per-head weights prepared for the GEMM, from kv_b_proj's weight as `source` gives
        it, read through kv_b_proj's form (the absorbed form never calls it); the module's other
        Linears are prepared as usual."""
        from titan_rl.kernels import gemm_weight

        w_uk_t, w_uv = self.split_heads(source(self.kv_b_proj))
        return heads_operand("absorbed", self.kv_b_proj, {"w_uk_t": [gemm_weight(w.detach()) for w in w_uk_t],
                                                         "w_uv": [gemm_weight(w.detach()) for w in w_uv]})


class SigmoidRouter(nn.Module):
    """transformers' GlmMoeDsaTopkRouter: `weight` [E, hidden] and `e_score_correction_bias` [E]
    (a parameter that is never trained: GLM-5 moves it outside the gradient, so here it is
    frozen, and it travels with the weights like any other tensor)."""

    def __init__(self, cfg: GlmDsaConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)


class DsaMoE(nn.Module):
    """Routed experts (each the dense decoder's SwiGLU MLP) combined per token in slot order in fp32, plus
    the shared experts (one MLP of moe_intermediate_size x n_shared_experts), added."""

    def __init__(self, cfg: GlmDsaConfig, ops: Ops):
        super().__init__()
        self.ops, self.cfg = ops, cfg
        self.gate = SigmoidRouter(cfg)
        expert = _mlp_config(cfg, cfg.moe_intermediate_size)
        self.experts = nn.ModuleList(MLP(expert, ops, "experts") for _ in range(cfg.n_routed_experts))
        self.shared_experts = (MLP(_mlp_config(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts), ops, "experts")
                               if cfg.n_shared_experts else None)
        self.routes = ChoicePoint("routes", lambda ids: compact_routes(ids, cfg.n_routed_experts))

    expert_parallel = None  # the trainer's expert parallelism, as models/common/moe.py's blocks

    def forward(self, x):
        c = self.cfg
        weights, ids, own = router_sigmoid_topk(
            x, self.gate.weight, self.gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.norm_topk_prob, c.routed_scaling_factor, sigmoid=lambda z: self.ops.elementwise(torch.sigmoid, z),
            route_override=self.routes.override, linear_fn=self.ops.linear, topk_fn=self.ops.expert_topk)
        self.routes.record(ids, own)
        out = (self.expert_parallel or moe_experts)(x, ids, weights, self.experts)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def _mlp_config(cfg: GlmDsaConfig, width: int):
    """The fields the dense MLP reads (hidden_size, intermediate_size)."""
    from types import SimpleNamespace

    return SimpleNamespace(hidden_size=cfg.hidden_size, intermediate_size=width)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GlmDsaConfig, layer_idx: int, ops: Ops):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx, ops)
        sparse = cfg.mlp_layer_types[layer_idx] == "sparse"
        self.mlp = DsaMoE(cfg, ops) if sparse else MLP(_mlp_config(cfg, cfg.intermediate_size), ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, x, positions, cache: LatentCache, shared):
        a, used = self.self_attn(self.input_layernorm(x), positions, cache, shared)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), used


# -- the model ------------------------------------------------------------------------------

class GlmMoeDsaForCausalLM(CausalLM):
    """The dense causal LM's embedding, final norm, LM head, init and logits over GLM-5's decoder layers."""

    make_layer = DecoderLayer
    # the row-mixing op the execution contract names (titan_rl/contract.py)
    attention_op = "sparse_attention"

    # set by every forward (hidden_states)
    aux_loss: torch.Tensor | None = None
    indexer_loss: torch.Tensor | None = None  # mean over the indexer layers; None when they are not trained

    def __init__(self, cfg: GlmDsaConfig, options: ModelOptions = ModelOptions()):
        nn.Module.__init__(self)
        self.cfg = cfg.validate()
        self.options = options.validate()
        self.ops = Ops(options)
        self.model = Backbone(cfg, self.ops, DecoderLayer)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, self.ops)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def indexers(self) -> list[nn.Module]:
        return [layer.self_attn.indexer for layer in self.model.layers if layer.self_attn.indexer is not None]

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "GlmMoeDsaForCausalLM":
        super().init_weights(seed, std)
        with torch.no_grad():  # LayerNorm biases start at 0 (as nn.LayerNorm); the correction bias as initialised
            for m in self.modules():
                if isinstance(m, LayerNorm):
                    m.bias.zero_()
        return self

    # -- the flat-stream forward both engines share -------------------------------------
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: LatentCache,
                      inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        used, indexer_losses = None, []
        for layer in self.model.layers:
            x, used = layer(x, positions, cache, used)
            attn = layer.self_attn
            if attn.indexer_loss is not None:
                indexer_losses.append(attn.indexer_loss)
                attn.indexer_loss = None
        self.aux_loss = x.new_zeros((), dtype=torch.float32)
        self.indexer_loss = torch.stack(indexer_losses).mean() if indexer_losses else None
        return self.model.norm(x)

    # -- the trainer's batched forward -----------------------------------------------------
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, L] (each row starts at position 0) -> fp32 logits [B, L, V]."""
        B, L = tokens.shape
        cache = DenseLatents(B, L, tokens.device)
        h = self.hidden_states(tokens.reshape(-1), cache.row_pos, cache)
        return self.logits(h).view(B, L, -1)


__all__ = ["DenseLatents", "GlmMoeDsaForCausalLM", "KeyView", "LatentCache"]
