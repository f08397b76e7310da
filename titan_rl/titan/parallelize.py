"""TP and FSDP2 for the Qwen3 model definition, with the same logits on every layout.

TorchTitan calls `parallelize_qwen3(model, parallel_dims=..., training=..., parallelism=...,
compile_config=..., ac_config=..., dump_folder=...)` (its parallelize_fn signature);
`apply_tp` / `apply_fsdp` can also be used directly (tests, the RL trainer). The rollout
engine at tensor_parallel_size > 1 applies the same plan with `apply_tp_local` (plain
per-rank weight slices instead of DTensors; titan_rl/vllm/model.py).

The TP plan is read from the model: each decoder layer's Linears carry their kind
(`layer_tp_plan`). An architecture whose ArchitectureSpec.tp_plan is None refuses
TP > 1 with the spec's `no_tp_reason`; FSDP works for every architecture.

Exactness, layout by layout (torch.equal of the forward logits vs one process):
  * FSDP (any degree): weights are all-gathered before use, so every GEMM sees the same
    values and shapes as the unsharded model: exact by construction.
  * TP needs `tp_leaves = L > 0` in the model's config (Qwen3Config.tp_leaves, set by
    TitanModel.Config.tp_leaves), with which the model file itself (unsharded: trainer
    TP = 1 and the rollout engine) computes fixed-shape pieces; the sharded layers
    compute the same pieces (titan_rl.titan.tp_linear), with the model's own L:
      - column-parallel q/k/v/gate/up (weight Shard(0)): L fixed column blocks, a rank
        holds L/t of them and issues the same GEMM calls;
      - row-parallel o/down (weight Shard(1)): L K-leaves, each rank sums its subtree,
        all_gather, the same fixed tree on every rank;
      - attention runs on the rank's heads (the fixed-block attention kernel does not
        depend on the number of heads in the call);
      - GDN (qwen3_hybrid) runs on the rank's key heads and their value heads: in_proj_qkvz
        / in_proj_ba are laid out per key head (column-parallel = whole key heads per
        rank), out_proj is row-parallel over the value heads; conv, gates, L2 norms and
        the recurrence are per head and elementwise, so a head's bits do not depend on
        how many heads a call holds. The small per-head parameters (conv weight, A_log,
        dt_bias) stay replicated and each rank takes its heads' slice (`GdnHeads`);
    exact for TP = 1, 2, ..., L. With tp_leaves = 0: one GEMM per rank + all-reduce:
    close (~1e-6 in fp32), not bitwise.
  * q_norm / k_norm (per-head RMSNorm), GDN's gated norm and its sliced per-head
    parameters see only the rank's heads. With tp_leaves > 0 the norms' weight gradient
    is the model file's fixed tree over all heads' partials, the ranks' heads gathered
    (HeadNorm, GdnHeads: Ops.head_rms_norm); at tp_leaves = 0 it is all-reduced
    (copy_to_tp). The sliced conv weight, A_log and dt_bias are all-reduced over TP:
    each rank's gradient is zero outside its own heads, so the sum is exact (x + 0).
    The forward is unchanged.
  * Backward with tp_leaves > 0: a column-parallel input gradient is the fixed tree over
    all L blocks' partials (each rank one subtree, finished together), every weight
    gradient a GEMM of its block's or leaf's fixed shape, so the gradients equal
    TP = 1's (the model file computes the same pieces and trees).
  * Embedding, final norm and LM head are replicated under TP (the LM head is not
    vocab-parallel yet: every TP rank computes the full logits).
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_rl.kernels import linear as exact_linear
from titan_rl.models.qwen3 import Attention, Linear
from titan_rl.models.qwen3_hybrid import GatedDeltaNet
from titan_rl.registry import ArchitectureSpec, architecture_of, get_architecture
from titan_rl.titan import cpu_compat
from titan_rl.titan.tp_linear import _AllReduceSum, column_parallel_linear, copy_to_tp, gather_rows, row_parallel_linear

logger = logging.getLogger(__name__)


def _architecture(model: nn.Module) -> ArchitectureSpec:
    """The spec TorchTitan built the model from, else the one its class belongs to."""
    titan_config = getattr(model, "titan_config", None)
    return get_architecture(titan_config.arch) if titan_config is not None else architecture_of(model)


def layer_tp_plan(layer: nn.Module) -> dict[str, list[str]]:
    """The TP plan of one decoder layer, read from its Linears' kinds: "colwise" paths
    (kind "col": output columns split over TP ranks) and "rowwise" paths (kind "row":
    reduction dim K split). With tp_leaves > 0 the model file itself computes both kinds
    as fixed-shape pieces (kernels.linear_n_blocks / linear_k_leaves) and the sharded
    layers compute the same pieces (titan_rl.titan.tp_linear). "plain" Linears (an MoE
    router gate: every rank routes the same tokens identically) stay replicated.
    "heads": the token mixers (qwen3 Attention, GDN) whose heads the column split gives
    each rank; a rank computes its own heads (`shard_heads`)."""
    plan: dict[str, list[str]] = {"colwise": [], "rowwise": [], "heads": []}
    for path, mod in layer.named_modules():
        if isinstance(mod, Linear) and mod.kind != "plain":
            plan["colwise" if mod.kind == "col" else "rowwise"].append(path)
        elif isinstance(mod, (Attention, GatedDeltaNet)):
            plan["heads"].append(path)
    return plan


def check_tp_degree(cfg, tp: int, tp_leaves: int) -> None:
    heads = {key: getattr(cfg, key) for key in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads")
             if getattr(cfg, key, None) is not None}
    if any(n % tp for n in heads.values()):
        raise ValueError(f"tensor_parallel_degree = {tp} must divide " +
                         " and ".join(f"{key} ({n})" for key, n in heads.items()))
    if tp_leaves and tp_leaves % tp:
        raise ValueError(f"tensor_parallel_degree = {tp} must divide tp_leaves = {tp_leaves}")


def check_tp_supported(spec: ArchitectureSpec, tp: int) -> None:
    """TP > 1 needs a TP plan; an architecture without one says why (FSDP still works)."""
    if tp > 1 and spec.tp_plan is None:
        raise ValueError(
            f"parallelism.tensor_parallel_degree = {tp} is not supported for architecture {spec.name!r} "
            f"({spec.no_tp_reason}); use 1 (FSDP: parallelism.data_parallel_shard_degree)")


_MIXED: dict[tuple[type, type], type] = {}


def reclass(mod: nn.Module, mixin: type) -> None:
    """Give `mod` the forward of `mixin` (keeping its parameters and other methods);
    a previous parallel mixin is replaced, not stacked."""
    base = type(mod)
    while base.__dict__.get("_titan_mixed", False):
        base = base.__bases__[1]
    key = (mixin, base)
    if key not in _MIXED:
        _MIXED[key] = type(f"{mixin.__name__}_{base.__name__}", (mixin, base), {"_titan_mixed": True})
    mod.__class__ = _MIXED[key]


# -- tensor parallel ---------------------------------------------------------------------

def _kernel(mod):
    """The module's own linear (ops.linear: exact kernel or F.linear in 'stock' mode)."""
    return getattr(getattr(mod, "ops", None), "linear", exact_linear)


class ColwiseLinear(nn.Module):
    """Re-classing mixin: weight is a DTensor Shard(0) on the TP mesh; output = this
    rank's columns. The replicated input goes through copy_to_tp (backward all-reduce)."""

    tp_group = None
    tp_leaves: int = 0

    def forward(self, x):
        w = _local(self.weight)
        if self.tp_leaves:
            return column_parallel_linear(x, w, self.tp_group, self.tp_leaves)
        return _kernel(self)(copy_to_tp(x, self.tp_group), w)


class RowwiseLinear(nn.Module):
    """Re-classing mixin: weight is a DTensor Shard(1) on the TP mesh; input is this rank's
    K-share; output replicated (fixed leaf tree when tp_leaves > 0, else all-reduce)."""

    tp_group = None
    tp_leaves: int = 0

    def forward(self, x):
        w = _local(self.weight)
        if self.tp_leaves:
            return row_parallel_linear(x, w, self.tp_group, self.tp_leaves)
        return _AllReduceSum.apply(_kernel(self)(x, w), self.tp_group)


class HeadNorm(nn.Module):
    """Re-classing mixin for q_norm / k_norm under TP: the weight is replicated but each
    rank normalises only its own heads. With tp_leaves > 0 its weight gradient is the
    one-process model's fixed tree over all heads' partials (the ranks' heads gathered:
    kernels.rms_norm_heads); else the weight passes through copy_to_tp (identity
    forward, all-reduce of the ranks' partial sums backward)."""

    tp_group = None

    def forward(self, x):
        if self.ops.tp_leaves:
            return self.ops.head_rms_norm(x, self.weight, self.eps, partial(gather_rows, group=self.tp_group))
        return self.ops.head_rms_norm(x, copy_to_tp(self.weight, self.tp_group), self.eps)


class GdnHeads(nn.Module):
    """Re-classing mixin for a GDN layer under TP: its projections are sharded by whole
    key heads (rank r: key heads [r*hk/t, (r+1)*hk/t) and their value heads), so the
    layer's per-head parameters are this rank's share of the replicated conv weight,
    A_log and dt_bias (`gdn_rank_share`), each through copy_to_tp (identity forward,
    all-reduce of the ranks' gradients, zero outside their heads). The gated norm's
    weight is shared by all heads: the HeadNorm rule (a tree over heads with
    tp_leaves > 0, else copy_to_tp)."""

    tp_group = None
    tp_channels: torch.Tensor | None = None
    tp_value_heads: slice = slice(None)

    def head_params(self):
        g = self.tp_group
        heads = self.tp_value_heads
        norm_w = self.norm.weight if self.norm.tp_gather is not None else copy_to_tp(self.norm.weight, g)
        return (copy_to_tp(self.conv1d.weight, g)[self.tp_channels], copy_to_tp(self.A_log, g)[heads],
                copy_to_tp(self.dt_bias, g)[heads], norm_w)


def gdn_rank_share(hk: int, hv: int, dk: int, dv: int, rank: int, tp: int) -> tuple[torch.Tensor, slice]:
    """TP rank `rank` of `tp`'s share of a GDN layer: (indices of its conv channels in
    the [q | k | v] layout of all heads, its value heads)."""
    hk_r, hv_r = hk // tp, hv // tp
    q = torch.arange(rank * hk_r * dk, (rank + 1) * hk_r * dk)
    v = torch.arange(rank * hv_r * dv, (rank + 1) * hv_r * dv)
    return torch.cat([q, hk * dk + q, 2 * hk * dk + v]), slice(rank * hv_r, (rank + 1) * hv_r)


def shard_heads(mixer: nn.Module, group) -> None:
    """Make a token mixer (qwen3 Attention or a GDN layer) compute this TP rank's heads
    (its projections are sharded by `apply_tp`)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if isinstance(mixer, GatedDeltaNet):
        mixer.tp_channels, mixer.tp_value_heads = gdn_rank_share(mixer.hk, mixer.hv, mixer.dk, mixer.dv, rank, tp)
        reclass(mixer, GdnHeads)
        mixer.tp_group = group
        if mixer.ops.tp_leaves:
            mixer.norm.tp_gather = partial(gather_rows, group=group)
        mixer.hk, mixer.hv = mixer.hk // tp, mixer.hv // tp
        return
    for norm in (mixer.q_norm, mixer.k_norm):
        reclass(norm, HeadNorm)
        norm.tp_group = group
    mixer.h, mixer.hkv = mixer.h // tp, mixer.hkv // tp


def _local(w):
    return w.to_local() if isinstance(w, DTensor) else w


def _shard_param(mod: nn.Module, name: str, mesh, dim: int) -> None:
    p = getattr(mod, name)
    dt = distribute_tensor(p.data, mesh, [Shard(dim)], src_data_rank=None)
    setattr(mod, name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _decoder_layers(model: nn.Module):
    return model.get_submodule("model.layers")


def model_tp_leaves(model: nn.Module) -> int:
    """The leaf count the model file computes with: its config's tp_leaves in exact mode,
    0 in stock mode (which ignores tp_leaves)."""
    ops = getattr(model, "ops", None)
    if ops is not None and hasattr(ops, "tp_leaves"):
        return ops.tp_leaves
    return getattr(getattr(model, "cfg", None), "tp_leaves", 0)


def apply_tp(model: nn.Module, tp_mesh, tp_leaves: int | None = None) -> None:
    """Shard each decoder layer's "col" Linears (q/k/v/gate/up) by output rows (Shard(0))
    and its "row" Linears (o/down) by input columns (Shard(1)) on `tp_mesh` (the plan:
    `layer_tp_plan`); every rank must hold the same full weights (or meta).
    The sharded layers use the model's own leaf count (`model_tp_leaves`); `tp_leaves`,
    if given, must equal it (anything else would compute other bits than the model file
    and the rollout engine)."""
    _apply_tp(model, tp_mesh.get_group(), tp_leaves,
              lambda lin, dim: _shard_param(lin, "weight", tp_mesh, dim))


def apply_tp_local(model: nn.Module, group) -> dict[str, int]:
    """The rollout engine's form of `apply_tp` (the same plan, layers and leaf tree): each
    sharded weight becomes this rank's slice as a plain tensor (no DTensor: the engine
    never trains). Returns {parameter name: the dim it is split on}, so that a loader of
    full weights can take this rank's slice (`local_shard`)."""
    split: dict[str, int] = {}
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    names = {id(m): n for n, m in model.named_modules()}

    def take_slice(lin: nn.Module, dim: int) -> None:
        w = lin.weight
        lin.weight = nn.Parameter(local_shard(w.data, dim, rank, tp), requires_grad=w.requires_grad)
        split[f"{names[id(lin)]}.weight"] = dim

    _apply_tp(model, group, None, take_slice)
    return split


def local_shard(full: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s slice of a full weight split in `tp` equal parts along `dim` (what
    Shard(dim) holds)."""
    return full.chunk(tp, dim)[rank].contiguous()


def _apply_tp(model: nn.Module, group, tp_leaves: int | None, shard_weight) -> None:
    """The TP plan applied to every decoder layer; `shard_weight(linear, dim)` replaces the
    Linear's weight by this rank's share along `dim`."""
    spec = _architecture(model)
    if spec.tp_plan is None:
        raise ValueError(f"architecture {spec.name!r} has no TP plan ({spec.no_tp_reason})")
    tp = dist.get_world_size(group)
    own = model_tp_leaves(model)
    if tp_leaves is not None and tp_leaves != own:
        raise ValueError(f"apply_tp(tp_leaves={tp_leaves}) differs from the model's tp_leaves = {own} "
                         "(set it in the model config: TitanModel.Config.tp_leaves / Qwen3Config.tp_leaves)")
    tp_leaves = own
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        check_tp_degree(cfg, tp, tp_leaves)
    if not tp_leaves:
        logger.warning("TP=%d with tp_leaves=0: logits are close to, not bitwise equal to, TP=1", tp)
    for layer in _decoder_layers(model):
        plan = layer_tp_plan(layer)
        for kind, dim, mixin in (("colwise", 0, ColwiseLinear), ("rowwise", 1, RowwiseLinear)):
            for path in plan[kind]:
                lin = layer.get_submodule(path)
                shard_weight(lin, dim)
                reclass(lin, mixin)
                lin.tp_group, lin.tp_leaves = group, tp_leaves
        for path in plan["heads"]:
            shard_heads(layer.get_submodule(path), group)


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
               gradient_divide_factor: float | None = None) -> None:
    """fully_shard each decoder layer, then the root (embedding, final norm, LM head: the
    LM head weight is read directly by `logits()`, so it must live in the root unit,
    which stays unsharded for the whole forward). On gloo, gradients are reduced with
    SUM (cpu_compat.force_sum_reduction)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if gradient_divide_factor is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(gradient_divide_factor)
    if dist.is_initialized() and "gloo" in str(dist.get_backend()).lower():
        cpu_compat.force_sum_reduction(model)


# -- the TorchTitan parallelize_fn -------------------------------------------------------

def parallelize_qwen3(model: nn.Module, *, parallel_dims, training=None, parallelism=None,
                      compile_config=None, ac_config=None, dump_folder: str = "",
                      skip_dp: bool = False, **unused):
    """TorchTitan's parallelize_fn for every architecture built from qwen3's pieces: TP
    (tp mesh; refused with the spec's reason when it has no TP plan), activation
    checkpointing, FSDP2 / HSDP (fsdp mesh, always applied like torchtitan does, for the
    mixed-precision policy). CP, PP, EP and torch.compile are refused."""
    check_tp_supported(_architecture(model), parallel_dims.tp)
    if compile_config is not None and getattr(compile_config, "enable", False):
        raise ValueError("torch.compile breaks batch invariance: set compile.enable = False")
    for what, on in (("context parallel", parallel_dims.cp_enabled),
                     ("pipeline parallel", parallel_dims.pp_enabled),
                     ("expert parallel", parallel_dims.ep_enabled)):
        if on:
            raise NotImplementedError(f"{what} is not supported for titan_rl models")

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
    apply_fsdp(
        model, dp_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        reshard_after_forward=policy != "never",
        # torchtitan normalises the loss by the global token count: no FSDP division.
        gradient_divide_factor=1.0,
    )
    return model
