"""Hugging Face-format checkpoint folders: save, strict load, fingerprint.

A folder is what `transformers` and vLLM read: `config.json` plus `model.safetensors`
(or shards `model-0000i-of-0000N.safetensors` listed in `model.safetensors.index.json`),
with Hugging Face parameter names. Our models already use those names, so nothing is
renamed on the way in or out.

Loading is strict: every parameter the model has must come from the checkpoint with its
exact shape, and the checkpoint may hold nothing else. All problems are gathered into ONE
`CheckpointError` naming each key (expected vs found shape) and the source, before any
weight is copied. Tied parameters (Qwen3's `lm_head.weight` shares
`model.embed_tokens.weight` when `tie_word_embeddings`) are written once, under the first
name, as Hugging Face does; on load the alias may be absent, or present with equal values.

`checkpoint_fingerprint` hashes names, shapes, dtypes and raw bytes, so two engines can
prove they hold the same weights to the bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titan_rl.dtypes import dtype_name
from titan_rl.errors import CheckpointError
from titan_rl.kernels.mode import KernelMode
from titan_rl.models.options import ModelOptions
from titan_rl.registry import ArchitectureSpec, get_architecture, list_architectures

__all__ = [
    "CheckpointError",
    "CONFIG_NAME",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "check_hf_folder",
    "checkpoint_fingerprint",
    "load_hf_folder",
    "load_state_dict_strict",
    "save_hf_folder",
    "saved_state_dict",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


# ---------------------------------------------------------------------------------------
# tied parameters
# ---------------------------------------------------------------------------------------
def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias name: canonical name} for parameters/buffers registered under several names.

    The canonical name is the first one in registration order (for Qwen3:
    `model.embed_tokens.weight`; `lm_head.weight` is the alias), matching what Hugging Face
    writes for tied embeddings.
    """
    keys = set(model.state_dict().keys())
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if name not in keys:
            continue
        canonical = first.setdefault(id(t), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def saved_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None,
                     state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors `save_hf_folder` writes: HF names, tied aliases dropped, contiguous CPU
    tensors (cast to `dtype` when given; floating tensors only). `state_dict` replaces
    `model.state_dict()` (a sharded model's full tensors, whose DTensors cannot be saved)."""
    aliases = _tied_aliases(model)
    out = {}
    for name, t in (model.state_dict() if state_dict is None else state_dict).items():
        if name in aliases:
            continue
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.cpu().contiguous()
    return out


# ---------------------------------------------------------------------------------------
# strict validation (shared by the folder loader, load_state_dict_strict and vLLM's side)
# ---------------------------------------------------------------------------------------
def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _validate(model: torch.nn.Module, found: Mapping[str, tuple[int, ...]], source: str,
              where: Mapping[str, Path] | None = None) -> dict[str, str]:
    """Check checkpoint names/shapes against the model. Returns {checkpoint key: model key}
    to copy (one entry per tie group); raises one CheckpointError listing every problem
    (`where`: key -> the file holding it, named in the message)."""
    where = where or {}

    def _in(k: str) -> str:
        return f" in {where[k].name}" if k in where else ""

    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    aliases = _tied_aliases(model)
    groups: dict[str, list[str]] = {}
    for name in expected:
        groups.setdefault(aliases.get(name, name), []).append(name)

    problems: list[str] = []
    plan: dict[str, str] = {}
    for canonical, members in groups.items():
        present = [m for m in members if m in found]
        if not present:
            tied = f" (tied with {', '.join(members[1:])})" if len(members) > 1 else ""
            problems.append(f"missing key {canonical}{tied}: expected shape {_fmt_shape(expected[canonical])}")
            continue
        for m in present:
            if tuple(found[m]) != expected[m]:
                problems.append(
                    f"wrong shape for {m}: expected {_fmt_shape(expected[m])}, found {_fmt_shape(found[m])}{_in(m)}"
                )
        plan[present[0]] = canonical
    for name in sorted(k for k in found if k not in expected):
        problems.append(f"unexpected key {name}: found shape {_fmt_shape(found[name])}{_in(name)} (the model has no such parameter)")

    if problems:
        head = (
            f"checkpoint {source} does not match {type(model).__name__} "
            f"({len(problems)} problem{'s' if len(problems) != 1 else ''}):"
        )
        raise CheckpointError("\n  ".join([head, *problems]))
    return plan


def _tie_groups_present(model: torch.nn.Module, keys) -> list[tuple[str, str]]:
    """(alias, canonical) pairs where the checkpoint holds BOTH names of a tied parameter."""
    keys = set(keys)
    return [(a, c) for a, c in _tied_aliases(model).items() if a in keys and c in keys]


def _tied_conflict(alias: str, canonical: str, source: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {source}: {alias} and {canonical} are tied in the model but hold different values"
    )


def load_state_dict_strict(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source: str = "<state_dict>"
) -> torch.nn.Module:
    """Copy `state_dict` into `model` in place (cast to each parameter's dtype/device).

    Every model key must be present with its exact shape and no other key may be; all
    violations are reported together in one CheckpointError naming `source`. A tied alias
    (e.g. lm_head.weight under tie_word_embeddings) may be absent; if present it must equal
    its canonical tensor. Nothing is copied unless everything validates.
    """
    plan = _validate(model, {k: tuple(v.shape) for k, v in state_dict.items()}, source)
    for alias, canonical in _tie_groups_present(model, state_dict.keys()):
        if not torch.equal(state_dict[alias].cpu(), state_dict[canonical].cpu()):
            raise _tied_conflict(alias, canonical, source)
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for ckpt_key, model_key in plan.items():
            targets[model_key].copy_(state_dict[ckpt_key])
    return model


# ---------------------------------------------------------------------------------------
# folders
# ---------------------------------------------------------------------------------------
def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _atomic_save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def _spec_for_config(cfg) -> ArchitectureSpec:
    specs = [get_architecture(n) for n in list_architectures()]
    hits = [s for s in specs if any(type(f) is type(cfg) for f in s.flavors.values())]
    if len(hits) != 1:
        raise ValueError(
            f"cannot tell which registered architecture a {type(cfg).__name__} belongs to "
            f"(candidates: {[s.name for s in hits]}); pass arch="
        )
    return hits[0]


def save_hf_folder(
    model: torch.nn.Module,
    path: str | os.PathLike,
    architecture: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    arch: str | None = None,
    max_shard_bytes: int | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` as a Hugging Face folder: config.json + model.safetensors.

    config.json comes from the registry spec's `config_to_hf(model.cfg, architecture)`;
    `architecture` defaults to the spec's `vllm_architecture` (our wrapper); pass the
    spec's `hf_architecture` ("Qwen3ForCausalLM") to get a folder stock engines pick up.
    Tensors are written contiguous in `dtype`, under HF names, with tied aliases dropped
    (only `model.embed_tokens.weight` when embeddings are tied). With `max_shard_bytes`,
    weights are split into `model-0000i-of-0000N.safetensors` plus
    `model.safetensors.index.json`. Stale weight files of the other layout are removed so
    the folder never holds two copies of a key. `arch` (the registry name) defaults to
    the one architecture whose flavor configs have the type of `model.cfg`. `state_dict`
    (the same names as `model.state_dict()`) is written instead of the model's own
    tensors: a sharded trainer passes its full tensors. Returns the folder path.
    """
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        raise ValueError(f"{type(model).__name__} has no `.cfg`; cannot write config.json")
    spec = get_architecture(arch) if arch is not None else _spec_for_config(cfg)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    config = dict(spec.config_to_hf(cfg, architecture or spec.vllm_architecture))
    options = getattr(model, "options", None)
    if options is not None:  # how it computes, for the engine: tp_leaves, quantization
        config.update(options.to_hf())
    config["torch_dtype"] = config["dtype"] = dtype_name(dtype)
    tensors = saved_state_dict(model, dtype, state_dict)

    # Decide the layout, then clear weight files that belong to the other one.
    shards: list[dict[str, torch.Tensor]] = [tensors]
    if max_shard_bytes is not None:
        shards, size = [{}], 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
    n = len(shards)
    names = [WEIGHTS_NAME] if max_shard_bytes is None else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for old in path.iterdir():
        stale = old.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(old.name)
        if stale and old.name not in names:
            old.unlink()

    for name, shard in zip(names, shards):
        _atomic_save_file(shard, path / name)
    if max_shard_bytes is not None:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: name for name, shard in zip(names, shards) for k in shard},
        }
        _atomic_write_bytes(path / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
    _atomic_write_bytes(path / CONFIG_NAME, (json.dumps(config, indent=2) + "\n").encode())
    return path


def _read_config(path: Path) -> dict:
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path} is missing: a checkpoint folder needs config.json next to its *.safetensors")
    try:
        d = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object, found {type(d).__name__}")
    return d


def _weight_files(path: Path) -> list[Path]:
    index_path = path / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is not a valid safetensors index (needs a weight_map): {e}") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index_path} lists shard files that are missing from {path}: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weight files in {path}")
    return files


_SKIPPED_SAID: set[str] = set()


def _groups(keys: list[str]) -> str:
    groups: dict[str, int] = {}
    for k in keys:
        prefix = ".".join(k.split(".")[:2]) + ".*"
        groups[prefix] = groups.get(prefix, 0) + 1
    return ", ".join(f"{p} ({n})" for p, n in sorted(groups.items()))


def _skip_note(path: Path, skipped: list[str]) -> None:
    """One line, once per folder, for the tensors an architecture does not train."""
    if skipped and str(path) not in _SKIPPED_SAID:
        _SKIPPED_SAID.add(str(path))
        listed = _groups(skipped)
        print(f"note: {path}: {len(skipped)} tensors the text model does not use are not loaded: {listed}",
              file=sys.stderr, flush=True)


def _index_map(index_path: Path, key=None) -> dict[str, str]:
    """The index's weight_map (name -> file) under the names the shards are read with
    (`key`; the tensors it skips left out), so a vision-language folder's index is checked too."""
    weight_map = json.loads(index_path.read_text())["weight_map"]
    if key is None:
        return weight_map
    return {k: fn for hf_key, fn in weight_map.items() if (k := key(hf_key)) is not None}


def _scan(files: list[Path], path: Path, key=None) -> tuple[dict[str, tuple[int, ...]], dict[str, Path], dict[str, str]]:
    """Names -> shapes / file / stored dtype, from the safetensors headers (no data read).
    `key`: the architecture's HF name -> ours (None: not loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    dtypes: dict[str, str] = {}
    skipped: list[str] = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for hf_key in h.keys():
                    k = hf_key if key is None else key(hf_key)
                    if k is None:
                        skipped.append(hf_key)
                        continue
                    if k in where:
                        raise CheckpointError(f"key {k} appears in both {where[k].name} and {f.name} in {path}")
                    sl = h.get_slice(hf_key)
                    shapes[k], where[k], dtypes[k] = tuple(sl.get_shape()), f, sl.get_dtype()
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from e
    if skipped and not shapes:
        raise CheckpointError(f"{path}: only tensors of parts titan_rl does not load ({_groups(skipped)}): "
                              "it trains and serves the text model; a vision tower or MTP head alone is not supported")
    _skip_note(path, skipped)
    index_path = path / INDEX_NAME
    if index_path.is_file():
        weight_map = _index_map(index_path, key)
        wrong = sorted(k for k, fn in weight_map.items() if k not in where or where[k].name != fn)
        unlisted = sorted(k for k in where if k not in weight_map)
        if wrong or unlisted:
            raise CheckpointError(
                f"{index_path} disagrees with the shard files: "
                f"listed but not in the named file: {wrong}; in a file but not listed: {unlisted}"
            )
    return shapes, where, dtypes


def _check_architecture(d: dict, spec: ArchitectureSpec, cfg_path: Path) -> None:
    """config.json's `architectures` must name this spec: vLLM resolves its class from that
    field, so a folder of another architecture would otherwise load under the wrong model."""
    archs = d.get("architectures")
    if archs is None:
        return
    def names(s: ArchitectureSpec) -> set[str]:
        return {s.vllm_architecture, s.hf_architecture, *s.hf_aliases}

    allowed = names(spec)
    if not isinstance(archs, list) or not archs or not all(a in allowed for a in archs):
        others = [n for n in list_architectures()
                  if isinstance(archs, list) and names(get_architecture(n)) & set(archs)]
        hint = f"; that is model.name = {others[0]!r}" if others else ""
        raise CheckpointError(f"{cfg_path}: architectures = {archs!r} is not {spec.name!r} (model.name); "
                              f"allowed: {sorted(allowed)}{hint}")


def _folder_config(path: Path, arch: str, kernels: KernelMode = "exact"):
    """The folder exists, its config.json is valid and of architecture `arch`: (spec,
    config, the ModelOptions it records with `kernels`)."""
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint folder {path} {what}")
    spec = get_architecture(arch)
    d = _read_config(path)
    _check_architecture(d, spec, path / CONFIG_NAME)
    try:
        return spec, spec.config_from_hf(d), ModelOptions.from_hf(d, kernels)
    except KeyError as e:
        raise CheckpointError(f"{path / CONFIG_NAME} lacks the field {e.args[0]!r} needed to build {arch!r}") from e
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path / CONFIG_NAME}: {e}") from e


def folder_names(path: str | os.PathLike, arch: str) -> dict[str, str]:
    """Our tensor name -> the folder's, where they differ (a vision-language folder stores the
    text model under `model.language_model.`): what TorchTitan's HF load must ask DCP for."""
    spec = get_architecture(arch)
    if spec.checkpoint_key is None:
        return {}
    path = Path(path)
    names: dict[str, str] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as h:
            for hf_key in h.keys():
                k = spec.checkpoint_key(hf_key)
                if k is not None and k != hf_key:
                    names[k] = hf_key
    return names


def check_hf_folder(path: str | os.PathLike, arch: str = "qwen3"):
    """Everything `load_hf_folder` checks, without reading tensor data: the folder,
    config.json (valid, of architecture `arch`), the weight files (readable headers,
    sizes that cover their data) and every key and shape against the model, built on the
    meta device. Run before vLLM or DCP see a folder: their errors name no file.
    Returns the model config."""
    path = Path(path)
    spec, cfg, options = _folder_config(path, arch)
    files = _weight_files(path)
    shapes, where, _ = _scan(files, path, spec.checkpoint_key)
    with torch.device("meta"):
        model = spec.build(cfg, options)
    _validate(model, shapes, str(path), where)
    return cfg


_ST_FLOAT = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def load_hf_folder(
    path: str | os.PathLike, kernels: KernelMode = "exact", dtype: torch.dtype | None = None, arch: str = "qwen3"
) -> torch.nn.Module:
    """Build the registered architecture `arch` from `path`/config.json and load its weights.

    Reads every weight file of the folder (`model.safetensors`, or the shards named by
    `model.safetensors.index.json`), validates names and shapes strictly (one
    CheckpointError for all problems, naming keys, shapes and the folder), then copies
    tensor by tensor. `dtype`: the model's parameter dtype; None keeps the dtype the
    checkpoint stores (when all its floating tensors share one; float32 otherwise).
    """
    path = Path(path)
    spec, cfg, options = _folder_config(path, arch, kernels)
    files = _weight_files(path)
    shapes, where, stored = _scan(files, path, spec.checkpoint_key)
    if dtype is None:
        floats = {_ST_FLOAT[s] for s in stored.values() if s in _ST_FLOAT}
        dtype = floats.pop() if len(floats) == 1 else torch.float32

    model = spec.build(cfg, options)
    model.to(dtype)  # module.to keeps tied parameters tied
    plan = _validate(model, shapes, str(path), where)
    pairs = _tie_groups_present(model, shapes)
    alias_values: dict[str, torch.Tensor] = {}
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for hf_key in h.keys():
                    k = hf_key if spec.checkpoint_key is None else spec.checkpoint_key(hf_key)
                    if k in plan:
                        targets[plan[k]].copy_(h.get_tensor(hf_key))
                    elif any(k == a for a, _ in pairs):
                        alias_values[k] = h.get_tensor(hf_key)
    for alias, canonical in pairs:
        if not torch.equal(alias_values[alias].to(dtype), targets[canonical].detach()):
            raise _tied_conflict(alias, canonical, str(path))
    return model


# ---------------------------------------------------------------------------------------
# fingerprint (a tensor's and a prepared operand's digests: titan_rl.weight_digests)
# ---------------------------------------------------------------------------------------
def checkpoint_fingerprint(state_dict: Mapping[str, torch.Tensor] | torch.nn.Module) -> str:
    """sha256 hex digest over (name, dtype, shape, raw bytes) of every tensor, in sorted
    name order. Equal digests mean bitwise-equal weights under equal names.

    Given a module, hashes what `save_hf_folder` would write at the module's own dtype
    (tied aliases dropped), so `checkpoint_fingerprint(model)` equals the fingerprint of
    the saved safetensors when saved at the model's dtype.
    """
    if isinstance(state_dict, torch.nn.Module):
        state_dict = saved_state_dict(state_dict)
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        header = json.dumps([name, dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()])
        h.update(header.encode())
        h.update(b"\0")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
