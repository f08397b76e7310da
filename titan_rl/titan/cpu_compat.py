"""The CPU shims TorchTitan 0.3.0 needs, in one place.

TorchTitan 0.3.0 assumes an accelerator. On a CPU-only machine (the project's test
machines) five things break; `apply()` fixes each with the smallest patch that works and
is a no-op where an accelerator exists. Call it BEFORE importing torchtitan (importing
`titan_rl.titan` does that for you); calling it again is harmless.

  1. Device type. `torchtitan.tools.utils` computes `device_type, device_module` at import
     time from `torch._utils._get_available_device_type()`, which returns None without an
     accelerator, and falls back to "cuda". Every later `torch.cuda.*` call then fails.
     We import it while that query answers "cpu" (only when no accelerator is present),
     then restore the query. If torchtitan was imported first, we rewrite the module
     constants it already copied (device_type, device_module) instead.
  2. Memory queries. The metrics' DeviceMemoryMonitor calls `get_device_name`,
     `get_device_properties(...).total_memory`, `memory_stats`, `reset_peak_memory_stats`
     and `empty_cache` on the device module; `torch.cpu` has none of them. We add stubs
     (total memory from the OS, empty stats).
  3. `torchtitan.distributed.utils.set_pg_timeouts` (called after the first training
     step) issues `barrier(device_ids=[device_module.current_device()])`, which gloo
     rejects, then `torch.distributed.set_timeout`, which torch 2.13 lacks. We replace
     it with the same function minus device_ids, calling `_set_pg_timeout`.
  4. FSDP2 gradient reduction on gloo. FSDP2 reduces gradients with ReduceOp.AVG or
     PREMUL_SUM when the reduce dtype is fp32/bf16; gloo supports neither. FSDP2's
     `set_force_sum_reduction_for_comms(True)` makes it reduce with SUM and divide
     locally. torchtitan's `apply_fsdp_to_decoder` ends by calling
     `disable_fsdp_gradient_division` (gradient divide factor 1.0: the loss is already
     normalised by the global token count); we wrap that function so that on gloo it
     also forces SUM. `force_sum_reduction(model)` does the same for models sharded by
     our own parallelize function.
  5. Not a patch but a setting the caller must choose (see `trainer_overrides`):
     `parallelism.spmd_backend = "partial_dtensor"` (the default "spmd_types" path fails
     with torch 2.13's FSDP2), no torch.compile (it breaks batch invariance anyway),
     no FlexAttention (no CPU backward; our models use their own attention).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch

_APPLIED = False
_ORIG_GET_DEVICE_TYPE = None


def _accelerator_present() -> bool:
    fn = _ORIG_GET_DEVICE_TYPE or torch._utils._get_available_device_type
    return fn() is not None


def on_cpu() -> bool:
    """True when the shims are active (no accelerator on this machine)."""
    return not _accelerator_present()


def apply() -> None:
    """Install the shims. Idempotent; a no-op on a machine with an accelerator."""
    global _APPLIED, _ORIG_GET_DEVICE_TYPE
    if _APPLIED:
        return
    _ORIG_GET_DEVICE_TYPE = torch._utils._get_available_device_type
    if _accelerator_present():
        _APPLIED = True
        return

    # 1. torchtitan's device probe must see "cpu" (not its "cuda" fallback). The probe is
    #    patched only while torchtitan.tools.utils is imported (it binds the function and
    #    computes device_type at import); torch itself keeps the original, so nothing
    #    else in the process (nn.DataParallel, DCP, vLLM) sees a changed answer.
    def _get_available_device_type():
        return _ORIG_GET_DEVICE_TYPE() or "cpu"

    torch._utils._get_available_device_type = _get_available_device_type
    try:
        import torchtitan.tools.utils as tt_utils
    finally:
        torch._utils._get_available_device_type = _ORIG_GET_DEVICE_TYPE
    tt_utils._get_available_device_type = _get_available_device_type
    _fix_already_imported_torchtitan()

    # 2. torch.cpu lacks the memory queries torchtitan's memory monitor makes.
    _install_cpu_memory_stubs()

    # 3. and 4. patch torchtitan.distributed (imports torchtitan, now safe).
    _patch_torchtitan_distributed()
    _APPLIED = True


def _fix_already_imported_torchtitan() -> None:
    """If torchtitan was imported before apply(), its modules copied device_type="cuda"
    and device_module=torch.cuda at import: point them at the CPU."""
    for name, mod in list(sys.modules.items()):
        if not name.startswith("torchtitan") or mod is None:
            continue
        if getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"
        if getattr(mod, "device_module", None) is torch.cuda:
            mod.device_module = torch.cpu


def _install_cpu_memory_stubs() -> None:
    cpu = torch.cpu

    def total_memory() -> int:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 1 << 34

    stubs = {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: SimpleNamespace(
            name="cpu", total_memory=total_memory()
        ),
        # No allocator statistics on CPU: the monitor reports -1 / 0 for these.
        "memory_stats": lambda device=None: {},
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
    }
    for attr, fn in stubs.items():
        if not hasattr(cpu, attr):
            setattr(cpu, attr, fn)


def _set_pg_timeouts_cpu(timeout: timedelta, parallel_dims) -> None:
    """torchtitan's set_pg_timeouts without `device_ids` in the barrier (gloo rejects it).
    torchtitan 0.3.0 calls `torch.distributed.set_timeout`, which torch 2.13 does not
    have; the function is `distributed_c10d._set_pg_timeout`."""
    from torch.distributed import distributed_c10d as c10d

    set_timeout = getattr(torch.distributed, "set_timeout", None) or c10d._set_pg_timeout
    torch.distributed.barrier()
    groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in groups + [None]:
        set_timeout(timeout, group)


def _uses_gloo() -> bool:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    return "gloo" in str(torch.distributed.get_backend()).lower()


def force_sum_reduction(model: torch.nn.Module) -> int:
    """Make every FSDP2 unit of `model` reduce gradients with SUM (gloo has no AVG /
    PREMUL_SUM). The gradient divide factor each unit already has still applies: FSDP
    divides locally. Returns the number of units changed."""
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            n += 1
    return n


def _patch_torchtitan_distributed() -> None:
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.utils as tt_dist_utils

    if getattr(tt_dist_utils.set_pg_timeouts, "_titan_rl_shim", False) is False:
        _set_pg_timeouts_cpu._titan_rl_shim = True
        tt_dist_utils.set_pg_timeouts = _set_pg_timeouts_cpu

    orig = tt_fsdp.disable_fsdp_gradient_division
    if not getattr(orig, "_titan_rl_shim", False):

        def disable_fsdp_gradient_division(model):
            orig(model)
            if _uses_gloo():
                force_sum_reduction(model)

        disable_fsdp_gradient_division._titan_rl_shim = True
        tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def trainer_overrides(config) -> None:
    """Set the Trainer.Config fields titan_rl needs (in place): the partial_dtensor SPMD
    backend (spmd_types fails with torch 2.13's FSDP2) and no torch.compile (it changes
    the bits and breaks batch invariance). `training.mixed_precision_param` is left to
    the caller: it must be the dtype the rollout engine runs the weights in."""
    config.parallelism.spmd_backend = "partial_dtensor"
    config.compile.enable = False
