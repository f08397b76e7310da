"""TorchTitan's view of a registered architecture: a thin BaseModel adapter.

TorchTitan builds a model as `model_spec.model.build()` (under `torch.device("meta")`),
checks `verify_module_protocol()`, asks the config `update_from_config(config=...)` and
`get_nparams_and_flops(model, seq_len)`, calls `parallelize_fn`, `to_empty` and
`init_weights(buffer_device=...)`, then `model(tokens, **extra_kwargs)`.

`TitanModel.Config.build()` builds the ONE model definition through the registry
(`ArchitectureSpec.build(config, options)`) and re-classes the instance to a
subclass of (TitanModel, <the architecture's class>). Nothing is copied or wrapped:
parameter names stay the model's own (HF names), the forward is the model's own, and
the rollout engine builds the very same class. TitanModel only adds what TorchTitan
calls: init with a seed that works on sharded (DTensor) parameters, tolerance for the
extra forward kwargs TorchTitan passes, and the Module-protocol check skipped for the
model's plain nn.Module submodules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torchtitan.protocols.model import BaseModel

from titan_rl.models.options import ModelOptions
from titan_rl.registry import get_architecture


_TITAN_CLASSES: dict[type, type] = {}


def _titan_class(arch_cls: type) -> type:
    cls = _TITAN_CLASSES.get(arch_cls)
    if cls is None:
        cls = type(f"Titan{arch_cls.__name__}", (TitanModel, arch_cls), {"__module__": __name__})
        _TITAN_CLASSES[arch_cls] = cls
    return cls


class TitanModel(BaseModel):
    """Base of the re-classed models (never instantiated directly: use Config.build())."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        arch: str = "qwen3"
        """Registered architecture name (titan_rl.registry)."""
        flavor: str = "debug"
        """Flavor of the architecture (ignored when `model_config` is given)."""
        model_config: Any = None
        """The architecture's own config object (e.g. Qwen3Config); None: flavors[flavor]."""
        options: ModelOptions = ModelOptions()
        """How the model computes (kernel mode, TP leaves, quantization): the model's Ops
        read it, and config.json carries it to the rollout engine (models/options.py)."""
        init_seed: int = 0
        init_std: float = 0.02
        frozen: tuple[str, ...] = ()
        """Parameters built with requires_grad = False (name substrings; model.freeze_indexer:
        the indexers'): they get no gradient and stay out of the optimizer."""
        checkpoint_names: dict[str, str] = field(default_factory=dict)
        """Our tensor name -> the HF folder's where they differ (titan_rl.checkpoint.folder_names):
        the state-dict adapter reads and writes the folder under these."""

        def arch_config(self):
            """The architecture's config (what build() builds)."""
            return self.model_config if self.model_config is not None else get_architecture(self.arch).flavors[self.flavor]

        def build(self, **kwargs):
            if kwargs:
                raise TypeError(f"TitanModel.Config.build() takes no arguments, got {sorted(kwargs)}")
            arch = get_architecture(self.arch)
            model = arch.build(self.arch_config(), self.options)
            for name, p in model.named_parameters():
                if any(f in name for f in self.frozen):
                    p.requires_grad_(False)
            model.__class__ = _titan_class(type(model))
            model.titan_config = replace(self)
            return model

        def update_from_config(self, *, config, **kwargs) -> None:
            """Validate the trainer's settings against the model (nothing to resize)."""
            cfg = self.arch_config()
            training = getattr(config, "training", None)
            max_pos = getattr(cfg, "max_position_embeddings", None)
            if training is not None and max_pos is not None and training.seq_len > max_pos:
                raise ValueError(
                    f"training.seq_len = {training.seq_len} exceeds the model's "
                    f"max_position_embeddings = {max_pos}"
                )
            parallelism = getattr(config, "parallelism", None)
            tp = getattr(parallelism, "tensor_parallel_degree", 1) if parallelism else 1
            plan = get_architecture(self.arch).tp_plan
            if tp > 1 and plan is not None:
                plan.check_degree(cfg, tp, self.options.tp_leaves, key="parallelism.tensor_parallel_degree")
            compile_cfg = getattr(config, "compile", None)
            if compile_cfg is not None and getattr(compile_cfg, "enable", False):
                raise ValueError(
                    "compile.enable = True is not allowed for titan_rl models: torch.compile "
                    "changes the bits and breaks batch invariance (docs/architecture.md)"
                )

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            cfg = self.arch_config()
            nparams = sum(p.numel() for p in model.parameters())
            n_emb = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding)
                        for p in m.parameters(recurse=False))
            layers = getattr(cfg, "num_hidden_layers", 0)
            heads = getattr(cfg, "num_attention_heads", 0)
            head_dim = getattr(cfg, "head_dim", 0)
            # torchtitan's dense estimate: 6 * non-embedding params + attention's 12*l*h*d*s
            # (the LM head weight counts as a GEMM even when tied to the embedding).
            dense = nparams - n_emb
            if getattr(cfg, "tie_word_embeddings", False):
                dense += n_emb
            flops = 6 * dense + 12 * layers * heads * head_dim * seq_len
            return nparams, flops

    titan_config: "TitanModel.Config"

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, **kwargs):
        """tokens [B, L] -> fp32 logits [B, L, V]. TorchTitan may pass `positions` (from
        document packing) and `attention_masks`: titan_rl's forward always starts each
        row at position 0 with causal attention, so anything else is refused."""
        if getattr(self, "_skip_lm_head", False):
            raise ValueError("ChunkedLossWrapper is not supported: the model returns fp32 logits "
                             "(use CrossEntropyLoss or an RL loss on the logits)")
        if kwargs.get("attention_masks") is not None:
            raise ValueError("attention_masks are not supported: rows are causal from position 0")
        if positions is not None:
            expect = torch.arange(tokens.shape[1], device=positions.device)
            if not torch.equal(positions.reshape(-1, tokens.shape[1]), expect.expand(positions.numel() // tokens.shape[1], -1)):
                raise ValueError("positions other than 0..L-1 per row are not supported")
        return _arch_class(type(self)).forward(self, tokens)

    def verify_module_protocol(self) -> None:
        """The model's own submodules are plain nn.Modules (one definition shared with the
        rollout engine), not torchtitan Modules: only the root is a BaseModel."""

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        self.init_weights(buffer_device=buffer_device)

    def init_weights(self, seed: int | None = None, std: float | None = None, **kwargs) -> "TitanModel":
        """Deterministic init from `seed`: the same values the architecture's own
        `init_weights(seed, std)` gives an unsharded model, whatever the sharding.
        Unsharded: delegates. Sharded (DTensor parameters): builds the full unsharded
        init on this rank and loads it (each rank keeps its shard)."""
        c = self.titan_config
        seed = c.init_seed if seed is None else seed
        std = c.init_std if std is None else std
        self._retie()
        arch_cls = _arch_class(type(self))
        if not any(_is_dtensor(p) for p in self.parameters()):
            arch_cls.init_weights(self, seed=seed, std=std)
            return self
        ref = get_architecture(c.arch).build(c.arch_config(), c.options)  # plain, unsharded
        ref.init_weights(seed=seed, std=std)
        load_full_state_dict(self, ref.state_dict())
        return self

    def _retie(self) -> None:
        """`to_empty()` from meta replaces each module's parameter separately, which
        unties shared weights; re-tie as the architecture defines (before init)."""
        cfg = self.titan_config.arch_config()
        if getattr(cfg, "tie_word_embeddings", False):
            emb = self.get_submodule("model.embed_tokens")
            head = self.get_submodule("lm_head")
            if head.weight is not emb.weight and not _is_dtensor(emb.weight):
                head.weight = emb.weight


def _arch_class(cls: type) -> type:
    """The architecture's own class under the Titan re-classing (and FSDP's, which
    re-classes again to FSDP<cls>)."""
    for c in cls.__mro__:
        if c is TitanModel or issubclass(c, TitanModel) or not issubclass(c, nn.Module):
            continue
        if c.__module__.startswith(("torchtitan.", "torch.")):
            continue
        return c
    raise TypeError(f"no architecture class in the MRO of {cls}")


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict that every rank holds into a (possibly FSDP / TP
    sharded) model: each rank keeps its own shard of the same full values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not any(_is_dtensor(p) for p in model.parameters()):
        with torch.no_grad():
            model.load_state_dict(full, strict=True)
        return
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, strict=True)
    )
