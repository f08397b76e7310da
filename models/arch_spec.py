"""ArchitectureSpec: the one typed description of an architecture that both engines read.

Each model folder's spec.py (models/<name>/spec.py) exports one, made by `architecture_spec`
from what is the folder's own (its model and config classes, flavors, names); titan_rl.registry
collects them. TorchTitan's side builds a ModelSpec from it (titan_rl/titan/spec.py),
vLLM's side registers `vllm_class` under `vllm_architecture` (titan_rl/vllm/plugin.py).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from titan_rl.models.options import ModelOptions
from titan_rl.parallel.plan import TPPlan


def flavor_config(flavors: dict, flavor: str, arch: str):
    """The config of flavor `flavor`; an unknown one is refused naming the allowed ones and
    the nearest."""
    if flavor not in flavors:
        near = difflib.get_close_matches(flavor, list(flavors), n=1, cutoff=0.5)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"model.flavor = {flavor!r} is unknown for {arch}; allowed: {sorted(flavors)}{hint}")
    return flavors[flavor]


def resolve_config(flavor, flavors: dict, arch: str, config_type: type, **overrides):
    """A flavor name or a config object (+ field overrides) -> the config to build."""
    if isinstance(flavor, str):
        flavor = flavor_config(flavors, flavor, arch)
    if not isinstance(flavor, config_type):
        raise TypeError(f"{arch} needs a {config_type.__name__}, got {type(flavor).__name__}")
    return replace(flavor, **overrides) if overrides else flavor


def config_to_hf(cfg, architecture: str) -> dict:
    """config.json of a model config for the `architectures` entry `architecture` (every
    folder's config class writes its own: hf_config)."""
    return cfg.hf_config(architecture)


@dataclass
class ArchitectureSpec:
    name: str                                   # e.g. "qwen3"
    model_class: type                           # the architecture's model (architecture_of finds it in an MRO)
    build: Callable[..., torch.nn.Module]       # build(flavor_or_config, options=ModelOptions(), **overrides)
    flavors: dict[str, Any]                     # flavor name -> model config
    config_from_hf: Callable[[dict], Any]       # HF config.json dict -> model config
    config_to_hf: Callable[[Any, str], dict]    # (model config, architecture name) -> config.json dict
    vllm_architecture: str                      # the `architectures` entry vLLM resolves to our wrapper
    hf_architecture: str                        # the stock HF/vLLM architecture with the same weights
    # other `architectures` entries whose folders hold this model (a vision-language folder's
    # text model: `checkpoint_key` maps its tensor names)
    hf_aliases: tuple[str, ...] = ()
    # an HF tensor name -> ours, or None: a tensor this architecture does not train (vision
    # tower, multi-token prediction head), skipped by every loader and counted once
    checkpoint_key: Callable[[str], str | None] | None = None
    # "module:Class" of the vLLM wrapper; the default serves any model built from qwen3's
    # pieces. A model with recurrent state (hybrid linear attention) names its own.
    vllm_class: str = "titan_rl.vllm.model:TitanForCausalLM"
    # the decoder layer's TP plan (models/<name>/parallelize.py), or None: no tensor
    # parallelism, for the reason in `no_tp_reason` (TP > 1 is refused with it)
    tp_plan: TPPlan | None = None
    no_tp_reason: str = ""
    # Requests carry a running state besides the KV cache (linear attention): the engine
    # needs vLLM's state cache, and prefix caching its "align" mode.
    recurrent_state: bool = False
    # A mixture of experts: a router picks experts per token (routes are recorded and can
    # be replayed; the router's auxiliary loss is trained).
    moe: bool = False
    # Sparse attention: an indexer picks each token's keys per layer (DeepSeek sparse attention,
    # GLM-5); the engine records the selected positions, the trainer recomputes or replays them
    # (rollout.index_selection).
    sparse_attention: bool = False
    # config.json attributes the exact engine overrides (vLLM keys behaviour off model_type:
    # GLM-5's would turn on vLLM's own MLA handling, which our wrapper replaces)
    vllm_overrides: dict = field(default_factory=dict)
    # why vLLM's CPU build cannot run the stock (built-in) model at any shape ("" where it can):
    # the stock column is then transformers' own decode-vs-forward pair
    stock_cpu_refusal: str = ""

    def __post_init__(self) -> None:
        if self.tp_plan is not None and not isinstance(self.tp_plan, TPPlan):
            raise ValueError(f"ArchitectureSpec {self.name!r}: tp_plan = {self.tp_plan!r}; "
                             "allowed: a TPPlan (titan_rl.parallel.plan) or None (with no_tp_reason)")
        if self.tp_plan is None and not self.no_tp_reason:
            raise ValueError(f"ArchitectureSpec {self.name!r}: tp_plan = None needs no_tp_reason "
                             "(the error TP > 1 gets)")

    @property
    def choice_kinds(self) -> tuple[str, ...]:
        """The choices its layers make that the engine records (titan_rl.choices): MoE routes,
        sparse attention's key sets."""
        return ("routes",) * self.moe + ("indices",) * self.sparse_attention

    def flavor(self, name: str):
        """The config of flavor `name` (refused by name when unknown)."""
        return flavor_config(self.flavors, name, self.name)


def architecture_spec(name: str, model_class: type, config_class: type, flavors: dict, **particular) -> ArchitectureSpec:
    """A model folder's ArchitectureSpec: what every folder's is alike derived from its model
    class, config class and flavors (`build`, whose default flavor is the first one; config.json
    both ways: config_class.from_hf and the config's hf_config); `particular`: the other
    ArchitectureSpec fields, which are the architecture's own (names, TP plan, vLLM wrapper...)."""
    default = next(iter(flavors))

    def build(flavor=default, options: ModelOptions = ModelOptions(), **overrides) -> torch.nn.Module:
        """The model of flavor `flavor` (a name or a config object; `overrides`: config fields)."""
        return model_class(resolve_config(flavor, flavors, name, config_class, **overrides), options)

    return ArchitectureSpec(name=name, model_class=model_class, build=build, flavors=flavors,
                            config_from_hf=config_class.from_hf, config_to_hf=config_to_hf, **particular)
