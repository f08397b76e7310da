"""GLM-5's architecture config (transformers' GlmMoeDsaConfig keys, `model_type = "glm_moe_dsa"`),
its flavor, and config.json both ways.

What transformers defines and we compute (docs/glm5.md): MLA attention (q and kv low-rank
projections, each followed by an RMSNorm; per head a "nope" part and an interleaved-RoPE
part), DeepSeek sparse attention (the lightning indexer picks `index_topk` keys per token;
`indexer_types` "shared" layers reuse the previous "full" layer's choice), the first
`mlp_layer_types == "dense"` layers with a dense MLP and the rest with a sigmoid-routed MoE
(`e_score_correction_bias`, group-limited top-k, `routed_scaling_factor`) plus shared experts.

Refused (each in one line naming the key): rope types other than "default" (YaRN's mscale),
attention / MLP biases, an activation other than silu, no `q_lora_rank` (the indexer reads
the q latent), a first layer whose indexer is "shared", group shapes the router cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's CPU attention backend allocates [pages, Hkv, page, 2 * head_size] per layer and takes
# these head sizes; one token's cache row (latent KV + indexer key) must fit 2 * head_size.
CACHE_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass(frozen=True)
class GlmDsaConfig:
    vocab_size: int = 997
    hidden_size: int = 200
    intermediate_size: int = 328  # the dense layers' MLP
    moe_intermediate_size: int = 72  # each routed expert; the shared experts: x n_shared_experts
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    q_lora_rank: int = 72
    kv_lora_rank: int = 40
    qk_nope_head_dim: int = 24
    qk_rope_head_dim: int = 16
    v_head_dim: int = 20
    n_routed_experts: int = 5
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    mlp_layer_types: tuple[str, ...] = ("dense", "sparse", "sparse")
    index_topk: int = 16
    index_head_dim: int = 24
    index_n_heads: int = 3
    indexer_types: tuple[str, ...] = ("full", "full", "full")
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # DeepSeek's balancing is aux-loss free (the correction bias); no auxiliary loss is trained
    router_aux_loss_coef: float = 0.0

    # -- derived ------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The RoPE width (transformers points `head_dim` at it too)."""
        return self.qk_rope_head_dim

    @property
    def cache_row(self) -> int:
        """One token's cache row: the latent KV [c_kv | k_rope] then the indexer key."""
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim

    @property
    def cache_head_size(self) -> int:
        """The head size vLLM's cache is allocated with (one kv head): the smallest whose
        2 * head_size holds a cache row."""
        return next(d for d in CACHE_HEAD_SIZES if 2 * d >= self.cache_row)

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]

    @property
    def index_layers(self) -> list[int]:
        """The layers that run their own indexer (the others reuse the previous one's sets)."""
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    # -- checks ---------------------------------------------------------------------------
    def validate(self) -> "GlmDsaConfig":
        n = self.num_hidden_layers
        for key in ("mlp_layer_types", "indexer_types"):
            v = getattr(self, key)
            if len(v) != n:
                raise ValueError(f"config.json: {key} = {list(v)}: needs num_hidden_layers = {n} entries")
        bad = [t for t in self.mlp_layer_types if t not in ("dense", "sparse")]
        if bad:
            raise ValueError(f"config.json: mlp_layer_types has {bad}; allowed: ['dense', 'sparse']")
        bad = [t for t in self.indexer_types if t not in ("full", "shared")]
        if bad:
            raise ValueError(f"config.json: indexer_types has {bad}; allowed: ['full', 'shared']")
        if n and self.indexer_types[0] != "full":
            raise ValueError(f"config.json: indexer_types[0] = {self.indexer_types[0]!r}: a 'shared' layer reuses the "
                             "previous 'full' layer's selection, so layer 0 must be 'full'")
        for key in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                    "v_head_dim", "index_topk", "index_n_heads", "moe_intermediate_size", "intermediate_size",
                    "vocab_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key} = {getattr(self, key)} must be >= 1")
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim = {self.qk_rope_head_dim}: needs an even number >= 2 (RoPE pairs)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"model.index_head_dim = {self.index_head_dim} must be >= qk_rope_head_dim = "
                             f"{self.qk_rope_head_dim} (the indexer rotates its first qk_rope_head_dim channels)")
        if self.cache_row > 2 * CACHE_HEAD_SIZES[-1]:
            raise ValueError(f"kv_lora_rank + qk_rope_head_dim + index_head_dim = {self.cache_row}: a token's cache row "
                             f"must fit vLLM's largest CPU cache row, 2 x {CACHE_HEAD_SIZES[-1]}")
        E, g = self.n_routed_experts, self.n_group
        if E % g:
            raise ValueError(f"model.n_routed_experts = {E} must be a multiple of n_group = {g}")
        if not 1 <= self.topk_group <= g:
            raise ValueError(f"model.topk_group = {self.topk_group} must be in 1..n_group ({g})")
        if g > 1 and E // g < 2:
            raise ValueError(f"model.n_group = {g}: each group needs >= 2 experts (a group's score is its top-2 sum)")
        reachable = E // g * self.topk_group
        if not 1 <= self.num_experts_per_tok <= reachable:
            raise ValueError(f"model.num_experts_per_tok = {self.num_experts_per_tok} must be in 1..{reachable} (the "
                             "experts of topk_group groups)")
        if self.n_shared_experts < 0:
            raise ValueError(f"model.n_shared_experts = {self.n_shared_experts} must be >= 0")
        return self

    def tp_widths(self) -> dict[str, int]:
        """The widths model.tp_leaves must divide: the column blocks of q_b_proj, kv_b_proj and
        the MLPs' gate / up, the K-leaves of o_proj and the MLPs' down."""
        h = self.num_attention_heads
        widths = {"num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)": h * self.qk_head_dim,
                  "num_attention_heads*(qk_nope_head_dim+v_head_dim)": h * (self.qk_nope_head_dim + self.v_head_dim),
                  "num_attention_heads*v_head_dim": h * self.v_head_dim}
        if "dense" in self.mlp_layer_types:
            widths["intermediate_size"] = self.intermediate_size
        if "sparse" in self.mlp_layer_types:
            widths["moe_intermediate_size"] = self.moe_intermediate_size
            if self.n_shared_experts:
                widths["moe_intermediate_size*n_shared_experts"] = self.moe_intermediate_size * self.n_shared_experts
        return widths

    # -- config.json ----------------------------------------------------------------------
    def hf_config(self, architecture: str = "TitanGlmMoeDsaForCausalLM", dtype: str = "bfloat16") -> dict:
        """config.json content that transformers parses as a GlmMoeDsaConfig."""
        return {
            "architectures": [architecture],
            "model_type": "glm_moe_dsa",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "mlp_layer_types": list(self.mlp_layer_types),
            "first_k_dense_replace": self.mlp_layer_types.count("dense"),
            "index_topk": self.index_topk,
            "index_head_dim": self.index_head_dim,
            "index_n_heads": self.index_n_heads,
            "indexer_types": list(self.indexer_types),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": dtype,
            "dtype": dtype,
            "bos_token_id": 0,
            "eos_token_id": 1,
        }

    @classmethod
    def from_hf(cls, d: dict) -> "GlmDsaConfig":
        if d.get("model_type", "glm_moe_dsa") != "glm_moe_dsa":
            raise ValueError(f"config.json model_type = {d.get('model_type')!r}, expected 'glm_moe_dsa'")
        rope = d.get("rope_parameters") or {}
        kind = rope.get("rope_type", d.get("rope_type", "default"))
        if kind != "default":
            raise ValueError(f"config.json rope_parameters.rope_type = {kind!r} is not supported; allowed: ['default']")
        for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if d.get(key, want) != want:
                raise ValueError(f"config.json {key} = {d[key]!r} is not supported; allowed: {want!r}")
        if d.get("q_lora_rank") is None:
            raise ValueError("config.json q_lora_rank = None is not supported: GLM-5's indexer reads the q latent "
                             "(allowed: an integer >= 1)")
        n = int(d["num_hidden_layers"])
        mlp = d.get("mlp_layer_types")
        if mlp is None:
            k = min(int(d.get("first_k_dense_replace", 3)), n)
            mlp = ["dense"] * k + ["sparse"] * (n - k)
        indexer = d.get("indexer_types") or ["full"] * n
        theta = rope.get("rope_theta", d.get("rope_theta", 10_000.0))
        experts = d["n_routed_experts"] if "n_routed_experts" in d else d["num_local_experts"]
        return cls(
            vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]), moe_intermediate_size=int(d["moe_intermediate_size"]),
            num_hidden_layers=n, num_attention_heads=int(d["num_attention_heads"]),
            q_lora_rank=int(d["q_lora_rank"]), kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]), qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]), n_routed_experts=int(experts),
            num_experts_per_tok=int(d["num_experts_per_tok"]), n_shared_experts=int(d.get("n_shared_experts", 1)),
            n_group=int(d.get("n_group", 1)), topk_group=int(d.get("topk_group", 1)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)), mlp_layer_types=tuple(mlp),
            index_topk=int(d["index_topk"]), index_head_dim=int(d["index_head_dim"]),
            index_n_heads=int(d["index_n_heads"]), indexer_types=tuple(indexer),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)), rope_theta=float(theta),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        ).validate()


FLAVORS: dict[str, GlmDsaConfig] = {
    # odd sizes (hidden 200, vocab 997, q latent 72, kv latent 40, v head 20, 3 indexer heads
    # of 24, 5 experts of 72 top-2): dense, sparse, sparse; each token attends to at most 16 keys
    "debug_glm5": GlmDsaConfig(),
}

