"""The GDN hybrid's architecture config (qwen3's plus the gated delta-rule layers), its
flavors, and config.json (parsed by transformers as a Qwen3Config; the GDN keys become
attributes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from titan_rl.models.qwen3.config import Qwen3Config

# The GDN kernel reduces over dk with a power-of-two halving tree (other sizes are padded)
# and keeps a [dk, dv] fp32 state per head and sequence: powers of two up to 256.
SUPPORTED_LINEAR_HEAD_DIMS = (16, 32, 64, 128, 256)
MODEL_TYPE = "qwen3"  # config.json parses as transformers' Qwen3Config; GDN keys become attributes


@dataclass(frozen=True)
class GdnConfig:
    """The gated delta-rule layers' fields (Qwen3-Next's config.json names), shared by every
    hybrid's config: their validation, widths, state shapes and config.json keys."""

    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4

    GDN_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim")

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the conv (and of its state): q, k and v of all heads."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_qkvz_dim(self) -> int:
        """Width of q, k, v and z of all heads (in_proj_qkvz's output)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            2 * self.linear_num_value_heads * self.linear_value_head_dim

    def linear_state_shapes(self, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per-sequence state of one GDN layer: conv [C, K-1], recurrent [Hv, dk, dv] (both
        fp32); `tp` > 1: one tensor-parallel rank's share (its heads' channels and heads)."""
        return ((self.linear_conv_dim // tp, self.linear_conv_kernel_dim - 1),
                (self.linear_num_value_heads // tp, self.linear_key_head_dim, self.linear_value_head_dim))

    def validate_gdn(self) -> None:
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key} = {getattr(self, key)} must be >= 1")
        hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
        if hv % hk:
            raise ValueError(
                f"model.linear_num_value_heads = {hv} must be a multiple of model.linear_num_key_heads = {hk} "
                "(each key head serves linear_num_value_heads / linear_num_key_heads value heads)")
        for key in ("linear_key_head_dim", "linear_value_head_dim"):
            if getattr(self, key) not in SUPPORTED_LINEAR_HEAD_DIMS:
                raise ValueError(f"model.{key} = {getattr(self, key)} is not supported; allowed: "
                                 f"{list(SUPPORTED_LINEAR_HEAD_DIMS)}")
        if not 2 <= self.linear_conv_kernel_dim <= 8:
            raise ValueError(f"model.linear_conv_kernel_dim = {self.linear_conv_kernel_dim} is not supported; "
                             "allowed: 2..8")

    def check_layer_types(self, layer_types, n_layers: int) -> None:
        """A hybrid's layer_types: one entry per layer, each "linear_attention" or "full_attention"."""
        allowed = ("linear_attention", "full_attention")
        if len(layer_types) != n_layers or any(t not in allowed for t in layer_types):
            raise ValueError(f"layer_types = {list(layer_types)}: needs num_hidden_layers = {n_layers} entries, each "
                             f"one of {list(allowed)}")

    def gdn_hf(self) -> dict:
        return {key: getattr(self, key) for key in self.GDN_FIELDS}

    @classmethod
    def gdn_from_hf(cls, d: dict, what: str) -> dict:
        missing = [key for key in cls.GDN_FIELDS if key not in d]
        if missing:
            raise ValueError(f"config.json lacks the hybrid keys {missing} (not a {what} checkpoint?)")
        return {key: int(d[key]) for key in cls.GDN_FIELDS}


@dataclass(frozen=True)
class Qwen3HybridConfig(Qwen3Config, GdnConfig):
    full_attention_interval: int = 4

    # -- layout ----------------------------------------------------------------------------
    def is_full_attention(self, layer_idx: int) -> bool:
        return (layer_idx + 1) % self.full_attention_interval == 0

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if self.is_full_attention(i) else "linear_attention"
                for i in range(self.num_hidden_layers)]

    def validate(self) -> "Qwen3HybridConfig":
        super().validate()
        if self.num_hidden_layers < 1:
            raise ValueError(f"model.num_hidden_layers = {self.num_hidden_layers} must be >= 1")
        self.validate_gdn()
        n, k = self.num_hidden_layers, self.full_attention_interval
        if not 2 <= k <= n:
            raise ValueError(
                f"model.full_attention_interval = {k} must be in 2..num_hidden_layers ({n}): the hybrid needs "
                "at least one GDN layer and one full-attention layer (layer i is full attention when "
                "(i + 1) % full_attention_interval == 0)")
        return self

    def tp_widths(self) -> dict[str, int]:
        hv = self.linear_num_value_heads
        return {
            **super().tp_widths(),
            "in_proj_qkvz (2*linear_num_key_heads*linear_key_head_dim + "
            "2*linear_num_value_heads*linear_value_head_dim)": self.linear_qkvz_dim,
            "in_proj_ba (2*linear_num_value_heads)": 2 * hv,
            "linear_num_value_heads*linear_value_head_dim": hv * self.linear_value_head_dim,
        }

    # -- config.json -------------------------------------------------------------------------
    def hf_config(self, architecture: str = "TitanQwen3HybridForCausalLM", dtype: str = "bfloat16") -> dict:
        d = super().hf_config(architecture, dtype)
        d.update(model_type=MODEL_TYPE, layer_types=self.layer_types,  # vLLM counts the layers of each kind from it
                 full_attention_interval=self.full_attention_interval, **self.gdn_hf())
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3HybridConfig":
        gdn = cls.gdn_from_hf(d, "qwen3_hybrid")
        if "full_attention_interval" not in d:
            raise ValueError("config.json lacks the hybrid keys ['full_attention_interval'] (not a qwen3_hybrid "
                             "checkpoint?)")
        base = asdict(Qwen3Config.from_hf(d))
        cfg = cls(**base, **gdn, full_attention_interval=int(d["full_attention_interval"])).validate()
        if "layer_types" in d and list(d["layer_types"]) != cfg.layer_types:
            raise ValueError(f"config.json layer_types = {d['layer_types']} disagrees with full_attention_interval "
                             f"= {cfg.full_attention_interval} (expected {cfg.layer_types})")
        return cfg


FLAVORS: dict[str, Qwen3HybridConfig] = {
    # ~3.9M parameters: layers 0-2 GDN, layer 3 full attention. Trains in seconds on CPU.
    "debug_hybrid": Qwen3HybridConfig(),
    # ~50M parameters (10 layers: 8 GDN, 2 full attention): benchmarks.
    "small_hybrid": Qwen3HybridConfig(
        vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    ),
}
