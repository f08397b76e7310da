"""TOML -> typed config dataclasses, strictly.

Every section is a dataclass: titan_rl's own (model, sampling, rollout, parity, algorithm,
correction, task, eval, quantization) and TorchTitan's own Config classes under their TorchTitan names
(training, optimizer, lr_scheduler, parallelism, checkpoint, metrics, ...; see
titan_rl.titan.sections). An unknown section or key, a wrong type, a value outside its
allowed set (a Literal type) or a key titan_rl refuses is a ConfigError
naming the key, the value, what is allowed (or why not) and the nearest valid key.
Overrides use `--section.key=value` (TOML value syntax).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import difflib
import types
import typing
from typing import Literal
from dataclasses import dataclass, field
from pathlib import Path

import tomli

# [correction] is the algorithm's own config dataclass (one definition, validated there).
from titan_rl.algorithms.corrections import CorrectionConfig
from titan_rl import layout
from titan_rl.errors import ConfigError
from titan_rl.kernels.mode import KernelMode
from titan_rl.models.options import ModelOptions, Quantization
from titan_rl.kernels.quant.recipes import (
    QUANT_LAYERS, QUANT_RECIPES, ActivationScale, QuantLayer, QuantRecipe, check_activation_scale, check_stock_recipe,
)
from titan_rl.titan.sections import (
    REFUSED_AC_MODES, REFUSED_KEYS, REFUSED_SECTIONS, SECTIONS, ActivationCheckpointConfig, CheckpointManager,
    CommConfig, DebugConfig, LRSchedulersContainer, MetricsProcessor, OptimizerConfig, ParallelismConfig,
    Profiler, TrainingConfig,
)


@dataclass
class ModelConfig:
    name: str = "qwen3"  # a registered architecture, or "auto": the one model.checkpoint's config.json names
    flavor: str = "debug"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    checkpoint: str = ""  # local HF folder (config.json + *.safetensors); "" = random weights
    seed: int = 0  # random-weight seed
    init_std: float = 0.02
    tp_leaves: int = 0  # >0: fixed leaf tree for TP-invariant linears (8 covers TP 1/2/4/8)
    # "stock": plain torch trainer + vLLM's built-in engine (to measure what exactness removes)
    kernels: KernelMode = "exact"
    # sparse-attention models (GLM-5): no gradient to the indexers' parameters (GLM-5's RL setting);
    # false: they are trained by the indexer loss (docs/glm5.md), added x indexer_loss_coef
    freeze_indexer: bool = False
    indexer_loss_coef: float = 1.0


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    mask_mode: Literal["recompute", "replay"] = "recompute"  # RL: how the trainer gets the sampler's kept set


@dataclass
class RolloutConfig:
    kv_cache_mib: int = 256
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 0  # 0 = vLLM's default (no forced chunking)
    enable_prefix_caching: bool = True
    block_size: int = 0  # the KV cache's block (a prefix-cache hit's grain); 0 = vLLM's default
    max_model_len: int = 1024
    # MoE models: "off" = the trainer's router chooses (expert_disagreement is measured),
    # "replay" = the trainer uses exactly the experts the sampler recorded.
    router_replay: Literal["off", "replay"] = "off"
    # sparse-attention models (GLM-5): "pinned" = the trainer's indexer recomputes each token's
    # key set (bitwise-equal scores and a fixed top-k: the same set; nothing shipped),
    # "replay" = the trainer attends to exactly the sets the sampler recorded (index_disagreement
    # is measured either way)
    index_selection: Literal["pinned", "replay"] = "pinned"
    # where the engines run (titan_rl/rl/separate_engines.py): "colocated" = one in-process
    # engine per trainer rank, generation and training alternate; "separate" = `engines`
    # engine processes of `engine_tp` workers each, started and driven by trainer rank 0
    placement: Literal["colocated", "separate"] = "colocated"
    engines: int = 1
    engine_tp: int = 1
    # separate: how many steps the engines may sample ahead of training (0 = synchronous);
    # each rollout is sampled with the weights of up to this many steps before
    max_off_policy_steps: int = 0
    restart_engines: bool = False  # separate: a dead engine process is restarted (else the run stops)
    # multi-turn environments (titan_rl.rl.episodes): how many episodes' environment calls run
    # at once; episodes are a function of their seeds whatever this is
    env_workers: int = 4


@dataclass
class ParityConfig:
    num_prompts: int = 40
    prompt_len_min: int = 4
    prompt_len_max: int = 200
    full_vocab_prompts: int = 2  # requests whose full-vocabulary log-probs are compared
    trainer_batch_sizes: list[int] = field(default_factory=lambda: [1, 3, 8])
    seed: int = 0
    # > 0: instead of random prompts, play this many episodes of [task] (one turn or many,
    # titan_rl.rl.episodes) on each engine and rescore every sampled token of every turn
    episodes: int = 0


# -- titan_rl's own RL sections --------------------------------------------------------
@dataclass
class AlgorithmConfig:
    group_size: int = 8
    # the prompts of the whole step, over all ranks: each data-parallel rank takes an equal
    # share, so it must be divisible by the data-parallel degree (titan_rl.rl.global_batch)
    prompts_per_step: int = 8
    updates_per_batch: int = 1
    clip_eps: float = 0.2  # 0 = no PPO clipping
    advantage_scale: Literal["std", "none"] = "std"
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    sft_steps: int = 40  # supervised warm-up on the task's format before RL
    sft_batch: int = 64  # the pairs of a whole SFT step, shared like prompts_per_step
    rl_lr_scale: float = 0.1  # RL steps use optimizer.lr * rl_lr_scale (policy gradients are noisier than SFT)
    # a non-finite loss or grad norm: "stop" the run before the optimizer step (the weights
    # and the last checkpoint stay finite), or "skip" the step (counted in metrics.jsonl)
    on_nonfinite: Literal["stop", "skip"] = "stop"


@dataclass
class TaskConfig:
    # a built-in short name, "reasoning_gym:<dataset>", "jsonl:<path>", "parquet:<path>" or
    # "package.module:Class" (docs/tasks.md); chat and library tasks use model.checkpoint's tokenizer
    name: str = "digit_reverse"
    kwargs: dict = field(default_factory=dict)


@dataclass
class EvalConfig:
    # greedy accuracy on held-out questions (titan_rl.rl.evaluation), logged in metrics.jsonl
    # before the first RL step and after every `interval`-th RL step's weight sync; 0 = off
    interval: int = 0
    n: int = 32  # questions: task.sample(n, the held-out seed of `seed`), the same at every evaluation
    seed: int = 0  # as `python -m titan_rl.eval --seed`: both draw the same questions
    max_new_tokens: int = 0  # 0 = the task's max_new_tokens


@dataclass
class QuantizationConfig:
    # one recipe for weights and activations of the covered linears (docs/quantization.md)
    recipe: QuantRecipe = "none"
    # the decoder linears it covers; embeddings, LM head, MoE router and GDN gates never are
    layers: list[QuantLayer] = field(default_factory=lambda: list(QUANT_LAYERS))
    # how an activation's dynamic scale is reduced: "row" (its own elements); "tensor" (the
    # whole batch) makes a row depend on its neighbours, which exact mode refuses
    activation_scale: ActivationScale = "row"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    # TorchTitan's own sections (titan_rl.titan.sections)
    training: TrainingConfig = field(default_factory=SECTIONS["training"])
    optimizer: OptimizerConfig = field(default_factory=SECTIONS["optimizer"])
    lr_scheduler: LRSchedulersContainer.Config = field(default_factory=SECTIONS["lr_scheduler"])
    parallelism: ParallelismConfig = field(default_factory=SECTIONS["parallelism"])
    checkpoint: CheckpointManager.Config = field(default_factory=SECTIONS["checkpoint"])
    metrics: MetricsProcessor.Config = field(default_factory=SECTIONS["metrics"])
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=SECTIONS["activation_checkpoint"])
    comm: CommConfig = field(default_factory=SECTIONS["comm"])
    debug: DebugConfig = field(default_factory=SECTIONS["debug"])
    profiler: Profiler.Config = field(default_factory=SECTIONS["profiler"])
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)

    def model_options(self) -> ModelOptions:
        """How the model computes, from [model] and [quantization]: the one ModelOptions the
        trainer's model, its checkpoint folders and the engine then carry unchanged."""
        q = self.quantization
        return ModelOptions(kernels=self.model.kernels, tp_leaves=self.model.tp_leaves,
                            quantization=Quantization(q.recipe, tuple(q.layers))).validate()


def _nearest(name: str, allowed) -> str:
    m = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.5)
    return f"; did you mean {m[0]!r}?" if m else ""


# Keys whose setting another key holds: the error names that key.
_RENAMED = {
    "optimizer.name": "optimizer.optimizer_name (TorchTitan's name)",
    "optimizer.beta1": "optimizer.betas = [beta1, beta2] (TorchTitan's name)",
    "optimizer.beta2": "optimizer.betas = [beta1, beta2] (TorchTitan's name)",
    "parity.mode": "model.kernels (the parity harness runs that mode unless --kernels says otherwise)",
}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_type(path: str, value, tp):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:
        return value
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]  # TOML has no null
        if float in arms and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if len(arms) == 1:
            return _check_type(path, value, arms[0])
        for arm in arms:
            with contextlib.suppress(ConfigError):
                return _check_type(path, value, arm)
        raise ConfigError(f"{path} = {value!r}: expected {' or '.join(map(_type_name, arms))}, "
                          f"got {type(value).__name__}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path} = {value!r} is not allowed; allowed: {list(args)}")
        return value
    if origin is list:
        (inner,) = args
        if not isinstance(value, list):
            raise ConfigError(f"{path} = {value!r}: expected a list of {_type_name(inner)}")
        return [_check_type(f"{path}[{i}]", v, inner) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} = {value!r}: expected a table")
        inner = args[1] if args else typing.Any
        return {k: _check_type(f"{path}.{k}", v, inner) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path} = {value!r}: expected a table of {tp.__name__}")
        required = [f.name for f in dataclasses.fields(tp)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in value]
        if missing:
            raise ConfigError(f"{path} = {value!r}: missing {missing}")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        for key in value:
            if key not in names:
                raise ConfigError(f"unknown key '{path}.{key}'; allowed: {names}{_nearest(key, names)}")
        return tp(**{k: _check_type(f"{path}.{k}", v, hints[k]) for k, v in value.items()})
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{path} = {value!r}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def _fill(obj, section: str, table: dict) -> None:
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj) if f"{section}.{f.name}" not in REFUSED_KEYS]
    for key, value in table.items():
        path = f"{section}.{key}"
        if path in REFUSED_KEYS:
            raise ConfigError(f"{path} = {value!r}: titan_rl does not take this TorchTitan key: {REFUSED_KEYS[path]}")
        if path in _RENAMED:
            raise ConfigError(f"{path} = {value!r}: this key is {_RENAMED[path]}")
        if key not in names:
            raise ConfigError(f"unknown key {path!r} (value {value!r}); allowed in [{section}]: {names}{_nearest(key, names)}")
        value = _check_type(path, value, hints[key])
        setattr(obj, key, value)


def from_dict(data: dict) -> Config:
    cfg = Config()
    sections = [f.name for f in dataclasses.fields(cfg)]
    for section, table in data.items():
        if section in REFUSED_SECTIONS:
            raise ConfigError(f"[{section}]: titan_rl does not take this TorchTitan section: {REFUSED_SECTIONS[section]}")
        if section not in sections:
            raise ConfigError(f"unknown section [{section}]; allowed: {sections}{_nearest(section, sections)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table, got {table!r}")
        _fill(getattr(cfg, section), section, table)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    from titan_rl.registry import architecture_of_folder, get_architecture

    if cfg.model.name == "auto":  # the architecture config.json names (resolved once, here)
        if not cfg.model.checkpoint:
            raise ConfigError("model.name = 'auto' needs model.checkpoint: the folder whose config.json names the "
                              "architecture")
        cfg.model.name = architecture_of_folder(cfg.model.checkpoint).name
    spec = get_architecture(cfg.model.name)
    if not cfg.model.checkpoint:
        try:
            spec.flavor(cfg.model.flavor)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    s = cfg.sampling
    if not 0.0 < s.top_p <= 1.0:
        raise ConfigError(f"sampling.top_p = {s.top_p}: must be in (0, 1]")
    if s.temperature <= 0:
        raise ConfigError(f"sampling.temperature = {s.temperature}: must be > 0 (greedy has no log-prob ratio to study)")
    if s.top_k < 0:
        raise ConfigError(f"sampling.top_k = {s.top_k}: must be >= 0 (0 = off)")
    try:
        cfg.correction.validate()
    except ValueError as e:
        raise ConfigError(f"[correction] {e}") from None
    a = cfg.algorithm
    for key in ("group_size", "prompts_per_step", "updates_per_batch", "sft_batch"):
        if getattr(a, key) < 1:
            raise ConfigError(f"algorithm.{key} = {getattr(a, key)}: must be >= 1")
    if a.group_size < 2:
        raise ConfigError(f"algorithm.group_size = {a.group_size}: GRPO needs >= 2 completions per prompt")
    if cfg.training.steps < 1:
        raise ConfigError(f"training.steps = {cfg.training.steps}: must be >= 1")
    if cfg.lr_scheduler.warmup_steps >= cfg.training.steps:
        raise ConfigError(f"lr_scheduler.warmup_steps = {cfg.lr_scheduler.warmup_steps} must be < training.steps = "
                          f"{cfg.training.steps} (TorchTitan's schedule needs at least one step after warm-up)")
    tp, leaves = cfg.parallelism.tensor_parallel_degree, cfg.model.tp_leaves
    if tp < 1:
        raise ConfigError(f"parallelism.tensor_parallel_degree = {tp}: must be >= 1")
    arch_cfg = model_config(cfg)
    try:
        options = cfg.model_options()
        if arch_cfg is not None:  # else the model build names the folder's problem
            options.check_widths(arch_cfg.tp_widths())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    key = "parallelism.tensor_parallel_degree"
    _layout(layout.check_plan, key, tp, spec)
    _layout(layout.check_tp_leaves, key, tp, leaves, why="for the trainer to stay bitwise equal to the engine")
    if tp > 1 and arch_cfg is not None:
        _layout(layout.check_widths, key, tp, arch_cfg, spec.tp_plan.divides)
    layout.check_expert_parallel(cfg, spec, arch_cfg)
    if cfg.rollout.router_replay == "replay" and not cfg.model.checkpoint:
        if not spec.moe:
            raise ConfigError(f"rollout.router_replay = 'replay' needs a mixture-of-experts model; "
                              f"model.name = {cfg.model.name!r} (flavor {cfg.model.flavor!r}) has no router")
    coef = cfg.model.indexer_loss_coef
    if not (math.isfinite(coef) and coef > 0):
        raise ConfigError(f"model.indexer_loss_coef = {coef!r}: must be a finite number > 0 (to leave the indexers "
                          f"untrained, set model.freeze_indexer = true)")
    for key, value, default in (("rollout.index_selection", cfg.rollout.index_selection, "pinned"),
                                ("model.freeze_indexer", cfg.model.freeze_indexer, False),
                                ("model.indexer_loss_coef", coef, 1.0)):
        if value != default and not spec.sparse_attention:
            raise ConfigError(f"{key} = {value!r} needs a sparse-attention model (an indexer); model.name = "
                              f"{cfg.model.name!r} has none")
    layout.check_leaves(cfg)
    ac_reason = REFUSED_AC_MODES.get(cfg.activation_checkpoint.mode)
    if ac_reason:
        raise ConfigError(f"activation_checkpoint.mode = {cfg.activation_checkpoint.mode!r}: {ac_reason}")
    _check_quantization(cfg)
    _check_model_len(cfg)
    _check_placement(cfg, spec)
    _check_ranges(cfg)
    _check_titan_sections(cfg)
    p = cfg.parity
    if not 1 <= p.prompt_len_min <= p.prompt_len_max:
        raise ConfigError(f"parity.prompt_len_min/max = {p.prompt_len_min}/{p.prompt_len_max}: need 1 <= min <= max")


def _check_quantization(cfg: Config) -> None:
    q = cfg.quantization
    if q.recipe == "none":
        return
    if cfg.model.kernels == "stock":
        _layout(check_stock_recipe, q.recipe)
        return
    try:
        check_activation_scale(q.activation_scale)
    except ValueError as e:
        raise ConfigError(f"quantization.{e}") from None
    _layout(layout.check_recipe, "parallelism.tensor_parallel_degree", cfg.parallelism.tensor_parallel_degree,
            q.recipe, hint="FSDP is fine: the forward quantizes the gathered weight")
    problem = _quantization_problem(cfg, q.recipe)
    if problem:
        allowed = ["none", *(r for r in QUANT_RECIPES[1:] if not _quantization_problem(cfg, r))]
        raise ConfigError(f"quantization.recipe = {q.recipe!r} cannot run on model {cfg.model.name!r} "
                          f"({cfg.model.checkpoint or cfg.model.flavor}): {problem}; allowed for this model: {allowed}")


def model_config(cfg: Config):
    """The architecture config the run builds: the checkpoint folder's config.json, or the
    flavor's (None where the folder has no readable config.json: the checkpoint checks say why)."""
    import json

    from titan_rl.registry import get_architecture

    spec = get_architecture(cfg.model.name)
    if not cfg.model.checkpoint:
        return spec.flavor(cfg.model.flavor)
    path = Path(cfg.model.checkpoint) / "config.json"
    try:
        return spec.config_from_hf(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# prime-rl's default bound; each version is one copy of the parameters in the trainer's memory
MAX_OFF_POLICY_STEPS = 8


def _check_placement(cfg: Config, spec) -> None:
    r = cfg.rollout
    if r.placement == "colocated":
        for key, default in (("engines", 1), ("engine_tp", 1), ("max_off_policy_steps", 0), ("restart_engines", False)):
            if getattr(r, key) != default:
                raise ConfigError(f"rollout.{key} = {getattr(r, key)!r} needs rollout.placement = 'separate' (the "
                                  "colocated engine is one in-process engine per rank, synchronous)")
        return
    if r.engines < 1:
        raise ConfigError(f"rollout.engines = {r.engines}: must be >= 1")
    if not 0 <= r.max_off_policy_steps <= MAX_OFF_POLICY_STEPS:
        raise ConfigError(f"rollout.max_off_policy_steps = {r.max_off_policy_steps}: allowed 0 (synchronous) to "
                          f"{MAX_OFF_POLICY_STEPS} (the trainer keeps one copy of the parameters per version it may "
                          "rescore at)")
    if r.engine_tp not in (1, 2):
        raise ConfigError(f"rollout.engine_tp = {r.engine_tp}: allowed 1 or 2")
    if r.engine_tp > 1:
        key = "rollout.engine_tp"
        _layout(layout.check_recipe, key, r.engine_tp, cfg.quantization.recipe)
        _layout(layout.check_plan, key, r.engine_tp, spec)
        _layout(layout.check_tp_leaves, key, r.engine_tp, cfg.model.tp_leaves,
                why="for the engine to compute the trainer's bits")
        _layout(layout.check_widths, key, r.engine_tp, model_config(cfg), spec.tp_plan.divides)


def _layout(check, *args, **kwargs) -> None:
    """A rule of titan_rl.layout / kernels.quant.recipes, its ValueError as a ConfigError."""
    try:
        check(*args, **kwargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_model_len(cfg: Config) -> None:
    arch_cfg = model_config(cfg)
    limit = getattr(arch_cfg, "max_position_embeddings", None)
    if limit is not None and cfg.rollout.max_model_len > limit:
        where = f"model.checkpoint {cfg.model.checkpoint!r}" if cfg.model.checkpoint else f"flavor {cfg.model.flavor!r}"
        raise ConfigError(f"rollout.max_model_len = {cfg.rollout.max_model_len} exceeds the model's "
                          f"max_position_embeddings = {limit} ({where}); set rollout.max_model_len <= {limit}")


def _quantization_problem(cfg: Config, recipe: str) -> str:
    """Why the model cannot be built with `recipe` ("" when it can): built on the meta
    device, so every covered linear's shape is checked against the recipe's blocks."""
    import json

    import torch

    from titan_rl.registry import get_architecture

    spec = get_architecture(cfg.model.name)
    arch_cfg = cfg.model.flavor
    if cfg.model.checkpoint:
        path = Path(cfg.model.checkpoint) / "config.json"
        if not path.is_file():
            return ""  # the checkpoint checks name the missing file
        arch_cfg = spec.config_from_hf(json.loads(path.read_text()))
    options = ModelOptions(kernels="exact", quantization=Quantization(recipe, tuple(cfg.quantization.layers)))
    try:
        with torch.device("meta"):
            spec.build(arch_cfg, options)
    except ValueError as e:
        return str(e)
    return ""


# (key, test, what is allowed): every numeric value with a range. A value outside it would
# not fail loudly later: a negative lr trains by gradient ascent, a zero eps divides by 0.
_RANGES = [
    ("optimizer.lr", lambda v: v > 0, "> 0"),
    ("optimizer.eps", lambda v: v > 0, "> 0"),
    ("optimizer.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1)"),
    ("optimizer.weight_decay", lambda v: v >= 0, ">= 0"),
    ("training.max_norm", lambda v: v > 0, "> 0"),
    ("lr_scheduler.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("lr_scheduler.decay_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("lr_scheduler.min_lr_factor", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("algorithm.rl_lr_scale", lambda v: v > 0, "> 0"),
    ("algorithm.sft_steps", lambda v: v >= 0, ">= 0"),
    ("algorithm.clip_eps", lambda v: v >= 0, ">= 0 (0 = no clipping)"),
    ("model.init_std", lambda v: v > 0, "> 0"),
    ("eval.interval", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("eval.n", lambda v: v >= 1, ">= 1"),
    ("eval.seed", lambda v: v >= 0, ">= 0"),
    ("eval.max_new_tokens", lambda v: v >= 0, ">= 0 (0 = the task's)"),
    ("sampling.max_tokens", lambda v: v >= 1, ">= 1"),
    ("rollout.kv_cache_mib", lambda v: v >= 1, ">= 1"),
    ("rollout.max_num_seqs", lambda v: v >= 1, ">= 1"),
    ("rollout.env_workers", lambda v: v >= 1, ">= 1"),
    ("rollout.block_size", lambda v: v == 0 or v % 32 == 0, "0 (vLLM's default) or a multiple of 32 (the CPU "
     "attention's blocks)"),
    ("rollout.max_num_batched_tokens", lambda v: v >= 0, ">= 0 (0 = vLLM's default)"),
    ("rollout.max_model_len", lambda v: v >= 2, ">= 2"),
    ("parity.num_prompts", lambda v: v >= 1, ">= 1"),
    ("parity.full_vocab_prompts", lambda v: v >= 0, ">= 0"),
    ("parity.trainer_batch_sizes", lambda v: len(v) > 0 and min(v) >= 1, "a non-empty list of sizes >= 1"),
    ("parallelism.data_parallel_shard_degree", lambda v: v == -1 or v >= 1, "-1 (all ranks) or >= 1"),
    ("checkpoint.interval", lambda v: v >= 1, ">= 1"),
    # TorchTitan refuses 1 (the newest copy may still be being written) with a traceback
    ("checkpoint.keep_latest_k", lambda v: v == 0 or v >= 2, "0 (keep all) or >= 2"),
    ("checkpoint.folder", lambda v: bool(v.strip()) and not Path(v).is_absolute() and ".." not in Path(v).parts,
     "a non-empty folder name inside the run dir"),
    ("metrics.log_freq", lambda v: v >= 1, ">= 1"),
]


def _check_ranges(cfg: Config) -> None:
    import math

    for key, ok, allowed in _RANGES:
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if isinstance(v, float) and not math.isfinite(v) or not ok(v):
            raise ConfigError(f"{key} = {v!r}: must be {allowed}")


def _check_titan_sections(cfg: Config) -> None:
    """TorchTitan's own checks (each class's __post_init__, which setting a key skips):
    rebuilt from its values, so a TorchTitan refusal is a ConfigError, not a traceback."""
    for section in SECTIONS:
        try:
            setattr(cfg, section, dataclasses.replace(getattr(cfg, section)))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"[{section}] {e}") from None


def validate_parity(cfg: Config) -> None:
    p, s = cfg.parity, cfg.sampling
    if p.episodes < 0:
        raise ConfigError(f"parity.episodes = {p.episodes}: must be >= 0 (0: random prompts)")
    if p.episodes == 0 and p.prompt_len_max + s.max_tokens > cfg.rollout.max_model_len:
        raise ConfigError(f"parity.prompt_len_max + sampling.max_tokens = {p.prompt_len_max + s.max_tokens} exceeds "
                          f"rollout.max_model_len = {cfg.rollout.max_model_len}")


def _parse_value(raw: str):
    try:
        return tomli.loads(f"v = {raw}")["v"]
    except tomli.TOMLDecodeError:
        return raw  # bare string


def load(path: str | Path | None, overrides: list[str] = ()) -> Config:
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomli.loads(p.read_text())
        except tomli.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    for ov in overrides:
        key, sep, raw = ov.removeprefix("--").partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {ov!r}: expected --section.key=value")
        section, name = key.split(".", 1)
        data.setdefault(section, {})[name] = _parse_value(raw)
    return from_dict(data)


def to_dict(cfg: Config) -> dict:
    """{section: {key: value}} of every key a TOML file may set (refused keys and None,
    which TOML cannot write, left out): what to_toml writes and a relaunch compares."""
    out = {}
    for f in dataclasses.fields(cfg):
        table = dataclasses.asdict(getattr(cfg, f.name))
        out[f.name] = {k: v for k, v in table.items() if v is not None and f"{f.name}.{k}" not in REFUSED_KEYS}
    return out


def to_toml(cfg: Config) -> str:
    out = []
    for section, table in to_dict(cfg).items():
        out.append(f"[{section}]")
        for k, v in table.items():
            out.append(f"{k} = {_toml_value(v)}")
        out.append("")
    return "\n".join(out)


def _toml_value(v):
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)
