"""TorchTitan's config sections, read from TOML into TorchTitan's own Config dataclasses.

`[training]`, `[optimizer]`, `[parallelism]`, ... are TorchTitan's Trainer.Config fields
under their TorchTitan names, so every TorchTitan knob (and any TorchTitan adds) is a TOML
key. What titan_rl cannot honour, or sets itself, is refused by name with the reason
(REFUSED_KEYS, REFUSED_SECTIONS). Where titan_rl adds to a TorchTitan section it does so in
a subclass of TorchTitan's class (the seed of the RL data; the catch-all optimizer group; the gradient reduction;
the choice of activation-checkpointing class), and `trainer_sections` hands TorchTitan
its plain classes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.config import CommConfig, DebugConfig
from torchtitan.config import ParallelismConfig as TitanParallelismConfig
from torchtitan.config import TrainingConfig as TitanTrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.tools.profiler import Profiler


@dataclass(kw_only=True, slots=True)
class TrainingConfig(TitanTrainingConfig):
    seed: int = 0
    """Seed of everything random in the RL loop (prompts, SFT pairs, sampling), as a pure
    function of (seed, step, rank). TorchTitan's own RNG seed is debug.seed."""


@dataclass(kw_only=True, slots=True)
class ParallelismConfig(TitanParallelismConfig):
    deterministic_reduction: bool | None = None
    """Gradients as a fixed tree over `gradient_leaves` leaves of the global batch and over
    the data-parallel ranks (titan_rl.titan.leaf_reduction): the same bits for any FSDP
    degree. Unset: on with model.kernels = "exact"; false: FSDP2's own reduce-scatter."""
    gradient_leaves: int = 0
    """The count of gradient leaves a step's global batch is cut into (a power of two,
    divisible by the data-parallel degree; each leaf is one forward and backward). 0: the
    largest power of two up to 2 (titan_rl.layout.AUTO_MAX_LEAVES) dividing the run's global batches."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig(OptimizersContainer.Config):
    """TorchTitan's optimizer config plus its catch-all parameter group as flat keys
    (ParamGroupConfig's optimizer_name, torch.optim's kwarg names): the group every
    parameter not matched by `param_groups` falls into."""

    optimizer_name: Literal["AdamW", "Adam"] = "AdamW"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0

    def catch_all(self) -> ParamGroupConfig:
        return ParamGroupConfig(pattern=r".*", optimizer_name=self.optimizer_name, optimizer_kwargs={
            "lr": self.lr, "betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay})


@dataclass(kw_only=True, slots=True)
class ActivationCheckpointConfig(FullAC.Config):
    """`mode` picks TorchTitan's activation-checkpointing class; the other keys are that
    class's fields."""

    mode: Literal["none", "full", "selective", "memory_budget"] = "none"


# section -> a factory of its default: TorchTitan's class, with titan_rl's defaults where they
# differ from TorchTitan's (a short CPU run: 60 steps, a checkpoint every 10, no warm-up).
SECTIONS: dict[str, Any] = {
    "training": lambda: TrainingConfig(steps=60),
    "optimizer": OptimizerConfig,
    "lr_scheduler": lambda: LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),
    "parallelism": ParallelismConfig,
    # initial_load_model_only = False: TorchTitan warns about True without an initial load
    "checkpoint": lambda: CheckpointManager.Config(enable=True, interval=10, keep_latest_k=2,
                                                   initial_load_model_only=False, last_save_model_only=False),
    "metrics": lambda: MetricsProcessor.Config(log_freq=1),
    "activation_checkpoint": ActivationCheckpointConfig,
    "comm": CommConfig,
    "debug": DebugConfig,
    "profiler": Profiler.Config,
}

_PP = "pipeline parallel is not supported for titan_rl models"
_CP = "context parallel is not supported for titan_rl models"
_HF_LOAD = "set from model.checkpoint (a local HF folder: TorchTitan loads it in HF format, model only)"
_LAST_SAVE = ("titan_rl's last checkpoint keeps the full training state so a finished run can be extended "
              "(raise training.steps); write an HF folder with titan_rl.checkpoint.save_hf_folder")

# "section.key" -> why titan_rl refuses it (any value: the key is titan_rl's to set, or
# TorchTitan would act on it in a way that breaks trainer == engine or the resume checks).
REFUSED_KEYS: dict[str, str] = {
    "training.local_batch_size": "the RL loop sets its batches (algorithm.prompts_per_step x group_size, "
                                 "algorithm.sft_batch)",
    "training.global_batch_size": "the RL loop sets its batches (algorithm.prompts_per_step x group_size, "
                                  "algorithm.sft_batch, global: each data-parallel rank takes its share)",
    "training.seq_len": "set from rollout.max_model_len",
    "training.mixed_precision_param": "set from model.dtype (the trainer computes in the rollout engine's dtype)",
    "training.dtype": "titan_rl keeps fp32 master weights; the compute dtype is model.dtype",
    "training.enable_cpu_offload": "the trainer's state is on the CPU already (CPU build)",
    "parallelism.spmd_backend": "titan_rl needs 'partial_dtensor' (TorchTitan's 'spmd_types' path fails with "
                                "torch 2.13's FSDP2)",
    "parallelism.enable_sequence_parallel": "titan_rl's TP linears (titan_rl.parallel.tp_linear) have no "
                                            "sequence-parallel layout",
    "parallelism.enable_fsdp_symm_mem": "needs CUDA symmetric memory (CPU build)",
    **{f"parallelism.{k}": _PP for k in (
        "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size")},
    **{f"parallelism.{k}": _CP for k in (
        "context_parallel_degree", "context_parallel_load_balancer", "context_parallel_ptrr_mask_key")},
    **{f"checkpoint.{k}": _HF_LOAD for k in (
        "initial_load_path", "initial_load_model_only", "initial_load_in_hf", "initial_load_in_hf_quantized")},
    "checkpoint.last_save_model_only": _LAST_SAVE,
    "checkpoint.last_save_in_hf": _LAST_SAVE,
    "checkpoint.export_dtype": _LAST_SAVE,
    "checkpoint.load_step": "titan_rl resumes from the newest checkpoint (metrics.jsonl is truncated to it and "
                            "the run dir's config is checked against it)",
    "checkpoint.exclude_from_loading": "a resume restores the whole state, so it replays the uninterrupted run",
    "checkpoint.create_seed_checkpoint": "the initial weights come from model.seed or model.checkpoint",
    "checkpoint.async_mode": "titan_rl reads the newest checkpoint right after a step (non-finite stop, "
                             "keep_latest_k, resume); an asynchronous save may still be in flight",
    "comm.mode": "titan_rl runs real gloo collectives (torchrun ranks)",
    "debug.batch_invariant": "TorchTitan's Trainer refuses it; titan_rl's own kernels are batch-invariant "
                             "(model.kernels = 'exact')",
    "debug.spmd_typechecking": "needs parallelism.spmd_backend = 'spmd_types', which titan_rl cannot use",
    "debug.moe_force_load_balance": "titan_rl's MoE router does not read it",
    "profiler.trace_post_processor": "a Python function, not a TOML value",
}

# Trainer.Config fields that are not TOML sections here, and why.
REFUSED_SECTIONS: dict[str, str] = {
    "compile": "torch.compile changes the bits and breaks batch invariance (trainer == engine)",
    "tokenizer": "the tokenizer is the task's ([task])",
    "dataloader": "prompts come from the task ([task]) as a pure function of (training.seed, step, rank)",
    "validator": "titan_rl has no validation dataset; RL metrics are in metrics.jsonl",
    "loss": "the RL loss is configured in [algorithm] and [correction]",
    "override": "TorchTitan's override imports replace model code, which voids trainer == engine",
    "model_spec": "built from [model]",
    "hf_assets_path": "set to the run dir (--run-dir)",
    "dump_folder": "set to the run dir (--run-dir)",
}

# The activation-checkpointing classes `mode` cannot pick, and why.
REFUSED_AC_MODES: dict[str, str] = {
    "selective": "SelectiveAC is not implemented for titan_rl models (use 'full' or 'none')",
    "memory_budget": "MemoryBudgetAC needs torch.compile, which breaks batch invariance",
}


def titan_config(obj, cls):
    """obj (a titan_rl subclass instance) as TorchTitan's plain `cls`."""
    return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if f.init})


def trainer_sections(cfg) -> dict[str, Any]:
    """The Trainer.Config keyword arguments the TOML sections give, as copies TorchTitan
    may change (the checkpoint's initial load and training's derived keys are the caller's)."""
    ac, o = cfg.activation_checkpoint, cfg.optimizer
    optimizer = titan_config(o, OptimizersContainer.Config)
    optimizer.param_groups = [*o.param_groups, o.catch_all()]
    return dict(
        training=titan_config(cfg.training, TitanTrainingConfig),
        optimizer=optimizer,
        activation_checkpoint=None if ac.mode == "none" else titan_config(ac, FullAC.Config),
        parallelism=titan_config(cfg.parallelism, TitanParallelismConfig),
        **{name: dataclasses.replace(getattr(cfg, name))
           for name in ("lr_scheduler", "metrics", "comm", "debug", "profiler")},
    )
