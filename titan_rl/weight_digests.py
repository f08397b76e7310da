"""The weights' digests: what each side of a weight sync multiplies by, hashed where it lives.

`tensor_digest` hashes a tensor's dtype, shape and bytes; `operand_digests` a prepared GEMM
operand by the bytes its kernel reads (the engine's prepared forms, kernels/linear_forms.py).
The trainer's side (titan_rl.quant_weights.trainer_digests) and the engine's
(TitanForCausalLM.weight_digests, in the engine's process) give {name: sha256};
`digest_differences` names what differs, `combined_digest` folds a side into the one figure
each metrics line carries (`WeightCheck`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from titan_rl.dtypes import dtype_name


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 hex digest of one tensor's dtype, shape and raw bytes."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(json.dumps([dtype_name(t.dtype), list(t.shape)]).encode() + b"\0")
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def operand_digests(name: str, operand) -> dict[str, str]:
    """{name: sha256} of a prepared GEMM operand (models.layers.engine_operands), by the bytes
    its kernel reads: a tensor's (one oneDNN reorders into its blocked layout is read back
    through oneDNN, to_dense), or, for an opaque prepared weight (PackedWeight, PackedQuant,
    PackedHead), each of its fields in order (tensors and the sizes / choices stored with
    them). A dict or list of operands gives one entry per element, `name.key`; None gives none."""
    if operand is None:
        return {}
    if isinstance(operand, dict):
        return {k: v for key, op in operand.items() for k, v in operand_digests(f"{name}.{key}", op).items()}
    if isinstance(operand, (list, tuple)):
        return {k: v for i, op in enumerate(operand) for k, v in operand_digests(f"{name}.{i}", op).items()}
    return {name: _operand_digest(operand)}


def _operand_digest(operand) -> str:
    if isinstance(operand, torch.Tensor):
        return tensor_digest(operand.to_dense() if operand.layout == torch._mkldnn else operand)
    h = hashlib.sha256(type(operand).__name__.encode() + b"\0")
    for field in type(operand).__slots__:
        v = getattr(operand, field)
        h.update(f"{field}={_operand_digest(v) if isinstance(v, torch.Tensor) else repr(v)}\0".encode())
    return h.hexdigest()


def digest_differences(expected: Mapping[str, str], held: Mapping[str, str]) -> list[str]:
    """The names whose digest differs between what an engine should hold (`expected`) and
    what it holds (`held`), or that one side lacks, sorted."""
    return sorted(n for n in expected.keys() | held.keys() if expected.get(n) != held.get(n))


def combined_digest(digests: Mapping[str, str] | list) -> str:
    """One sha256 over a side's {name: digest} (sorted by name), or over a list of such
    digests in order (an engine's TP ranks, several engines): the value each side reports
    after a sync (`WeightCheck`), so a metrics line carries both sides' figures, not a verdict."""
    items = sorted(digests.items()) if isinstance(digests, Mapping) else list(digests)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


@dataclass(frozen=True)
class WeightCheck:
    """What a weight sync's checksum saw: the combined digest of what the trainer's forward
    multiplies by and of what the engine holds (read in the engine's process). A sync whose
    sides differ stops the run before this is logged; logged, the two are the evidence."""

    trainer: str
    engine: str

    def metrics(self) -> dict:
        return {"weights_sha256_trainer": self.trainer, "weights_sha256_engine": self.engine,
                "weights_checksum_equal": self.trainer == self.engine}
