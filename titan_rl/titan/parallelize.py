"""TP and FSDP2 on TorchTitan's meshes, for every registered architecture.

TorchTitan calls `parallelize_fn(model, parallel_dims=..., training=..., parallelism=...,
compile_config=..., ac_config=..., dump_folder=...)`. TP applies the architecture's own plan
(models/<name>/parallelize.py, applied by titan_rl.parallel.plan) with DTensor weights;
the rollout engine applies the same plan with plain slices. FSDP all-gathers weights
before use, so every GEMM sees the unsharded model's values and shapes. Why each layout
gives the same bits, and where it does not: docs/torchtitan.md, "Layout invariance".
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from titan_rl.layout import check_plan
from titan_rl.models.arch_spec import ArchitectureSpec
from titan_rl.parallel.plan import apply_plan
from titan_rl.registry import architecture_of, get_architecture
from titan_rl.titan import cpu_compat

logger = logging.getLogger(__name__)


def _architecture(model: nn.Module) -> ArchitectureSpec:
    """The spec TorchTitan built the model from, else the one its class belongs to."""
    titan_config = getattr(model, "titan_config", None)
    return get_architecture(titan_config.arch) if titan_config is not None else architecture_of(model)


def check_tp_supported(spec: ArchitectureSpec, tp: int) -> None:
    """TP > 1 needs a TP plan; an architecture without one says why (FSDP still works)."""
    check_plan("parallelism.tensor_parallel_degree", tp, spec,
               fallback=" (FSDP: parallelism.data_parallel_shard_degree)")


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """The architecture's TP plan on `tp_mesh`, each split weight a DTensor Shard(dim);
    every rank must hold the same full weights (or meta). The sharded layers compute the
    model's own leaf pieces (its ModelOptions.tp_leaves)."""
    spec = _architecture(model)
    if spec.tp_plan is None:
        raise ValueError(f"architecture {spec.name!r} has no TP plan ({spec.no_tp_reason})")

    def shard(lin: nn.Module, dim: int) -> None:
        p = lin.weight
        dt = distribute_tensor(p.data, tp_mesh, [Shard(dim)], src_data_rank=None)
        lin.weight = nn.Parameter(dt, requires_grad=p.requires_grad)

    apply_plan(model, spec.tp_plan, tp_mesh.get_group(), shard)


def _decoder_layers(model: nn.Module):
    return model.get_submodule("model.layers")


# -- activation checkpointing ------------------------------------------------------------

def apply_full_ac(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant checkpoint). Parameter
    names are unchanged (no wrapper module). The recompute is the same deterministic
    arithmetic, so gradients are unchanged."""
    from torch.utils.checkpoint import checkpoint

    for layer in _decoder_layers(model):
        orig = layer.forward

        def fwd(*args, _orig=orig, **kwargs):
            return checkpoint(_orig, *args, use_reentrant=False, **kwargs)

        layer.forward = fwd


def _apply_ac_config(model: nn.Module, ac_config) -> None:
    if ac_config is None:
        return
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if isinstance(ac_config, FullAC.Config):
        apply_full_ac(model)
    elif isinstance(ac_config, SelectiveAC.Config):
        logger.warning("titan_rl: SelectiveAC is not supported for this model; no activation "
                       "checkpointing applied (use FullAC.Config() or None)")
    else:
        raise NotImplementedError(f"activation checkpointing {type(ac_config).__qualname__} is not supported")


# -- FSDP2 -------------------------------------------------------------------------------

def apply_fsdp(model: nn.Module, dp_mesh, *, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
               gradient_divide_factor: float | None = None, ignored_params: set | None = None) -> None:
    """fully_shard each decoder layer, then the root (embedding, final norm, LM head: the
    LM head weight is read directly by `logits()`, so it must live in the root unit,
    which stays unsharded for the whole forward). On gloo, gradients are reduced with
    SUM (cpu_compat.force_sum_reduction). `ignored_params` stay plain tensors (expert
    parallelism's experts)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored_params)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                ignored_params=ignored_params)
    if gradient_divide_factor is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(gradient_divide_factor)
    if dist.is_initialized() and "gloo" in str(dist.get_backend()).lower():
        cpu_compat.force_sum_reduction(model)


# -- the TorchTitan parallelize_fn -------------------------------------------------------

def parallelize_fn(model: nn.Module, *, parallel_dims, training=None, parallelism=None,
                      compile_config=None, ac_config=None, dump_folder: str = "",
                      skip_dp: bool = False, **unused):
    """TorchTitan's parallelize_fn for every registered architecture: TP by the
    architecture's plan (tp mesh; refused with the spec's reason when it has none),
    activation checkpointing, FSDP2 / HSDP (fsdp mesh, always applied like torchtitan
    does, for the mixed-precision policy), expert parallelism over the ep mesh
    (titan_rl/titan/expert_parallel.py: the experts stay out of FSDP). CP, PP and torch.compile
    are refused."""
    check_tp_supported(_architecture(model), parallel_dims.tp)
    if compile_config is not None and getattr(compile_config, "enable", False):
        raise ValueError("torch.compile breaks batch invariance: set compile.enable = False")
    for what, on in (("context parallel", parallel_dims.cp_enabled),
                     ("pipeline parallel", parallel_dims.pp_enabled)):
        if on:
            raise NotImplementedError(f"{what} is not supported for titan_rl models")
    if parallel_dims.ep_enabled and (parallel_dims.tp_enabled or parallel_dims.ep != parallel_dims.dp_shard):
        raise NotImplementedError(f"expert parallel {parallel_dims.ep} is built for ep == data_parallel_shard_degree "
                                  f"({parallel_dims.dp_shard}) without TP (tp = {parallel_dims.tp})")

    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"))
    _apply_ac_config(model, ac_config)
    if skip_dp:
        return model

    from torchtitan.config import TORCH_DTYPE_MAP

    dp_names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    dp_mesh = parallel_dims.get_mesh(dp_names)
    param_dtype = TORCH_DTYPE_MAP[training.mixed_precision_param] if training is not None else None
    reduce_dtype = TORCH_DTYPE_MAP[training.mixed_precision_reduce] if training is not None else None
    policy = getattr(parallelism, "fsdp_reshard_after_forward", "default") if parallelism else "default"
    experts = None
    if parallel_dims.ep_enabled:
        from titan_rl.titan.expert_parallel import apply_ep, expert_parameters

        apply_ep(model, parallel_dims.get_mesh("ep").get_group(), dp_mesh, param_dtype=param_dtype,
                 reduce_dtype=reduce_dtype)
        experts = set(expert_parameters(model))
    apply_fsdp(
        model, dp_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        reshard_after_forward=policy != "never",
        # torchtitan normalises the loss by the global token count: no FSDP division.
        gradient_divide_factor=1.0, ignored_params=experts,
    )
    return model
