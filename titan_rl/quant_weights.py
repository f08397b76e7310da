"""Quantized weights between trainer and engine (docs/quantization.md).

The trainer keeps full-precision masters and fake-quantizes them in its forward; the
engine holds each covered weight as a `QuantizedWeight` (payload + scales). A weight sync
quantizes the trainer's weights once (`quantized_state`) and ships payload + scales; the
checksum compares what each side multiplies by: the trainer's fake-quantized weights
(`fake_quantized_state`) against the engine's dequantized payloads (`engine_weights`), and the
operands the engine prepares once per load (`trainer_digests`, by the engine's own code).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from titan_rl.kernels.quant import QuantizedWeight, fake_quantize
from titan_rl.kernels.quant.recipes import QuantRecipe
from titan_rl.models.layers import Linear, engine_operands


def weight_recipes(model: torch.nn.Module) -> dict[str, QuantRecipe]:
    """{parameter name: recipe} of every quantized Linear's weight (the trainer's model or
    the engine's: the names are the model's own)."""
    return {f"{name}.weight": m.recipe for name, m in model.named_modules()
            if isinstance(m, Linear) and m.recipe is not None}


def quantized_state(state: Mapping[str, torch.Tensor], recipes: Mapping[str, QuantRecipe]
                    ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """`state` with each covered weight quantized once: what a sync ships."""
    return {n: QuantizedWeight.of(t, recipes[n]) if n in recipes else t for n, t in state.items()}


@torch.no_grad()
def fake_quantized_state(state: Mapping[str, torch.Tensor], recipes: Mapping[str, QuantRecipe]
                         ) -> dict[str, torch.Tensor]:
    """The weights the trainer's forward multiplies by (covered ones fake-quantized)."""
    return {n: fake_quantize(t, recipes[n], "weight") if n in recipes else t for n, t in state.items()}


def engine_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights an engine's forward multiplies by: its parameters, and each held quantized
    weight dequantized (from the packed bytes the quantized GEMM reads, where it runs; else
    from the held QuantizedWeight), under the parameter's name."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.qweight is not None:
            out[f"{name}.weight"] = m.held_weight()
    return out


def trainer_digests(model: torch.nn.Module, state: Mapping[str, torch.Tensor], recipes: Mapping[str, QuantRecipe],
                    sent: Mapping[str, torch.Tensor | QuantizedWeight]) -> dict[str, str]:
    """What an engine's weight_digests (titan_rl.vllm.model) must give after a sync of `sent`
    (`state` quantized by `recipes`), computed on the trainer's side: each weight its forward
    multiplies by (`state` fake-quantized where a recipe applies: its own code path), and each
    operand the engine prepares once per load, prepared here from `sent` by the engine's own
    preparation (models.layers.engine_operands over the trainer's model, which has the engine's
    modules under the same names; each operand hashed and dropped before the next is made).
    `state` and `sent` hold the weights as this engine (TP rank) holds them."""
    from titan_rl.weight_digests import operand_digests, tensor_digest

    out = {n: tensor_digest(w) for n, w in fake_quantized_state(state, recipes).items()}
    names = {id(p): n for n, p in model.named_parameters()}  # a tied LM head: the embedding's name

    def source(m: Linear):
        return sent[names[id(m.weight)]]

    for p in engine_operands(model, source):
        out.update(operand_digests(p.name, p.operand))
    return out


def state_bytes(state: Mapping[str, torch.Tensor | QuantizedWeight]) -> int:
    """Bytes of a state dict as shipped (payload + scales for quantized entries)."""
    return sum(t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size() for t in state.values())


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a model holds: parameters plus quantized payloads and scales."""
    params = {id(p): p for p in model.parameters()}
    held = sum(p.numel() * p.element_size() for p in params.values())
    return held + sum(m.qweight.nbytes for m in model.modules() if isinstance(m, Linear) and m.qweight is not None)


def weights_differ(when: str, engine: str, names: list[str], how: str) -> str:
    """The message that stops a run whose engine holds other weights than the trainer's
    forward uses after a sync (`names`: digest_differences, up to five shown)."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"weights {when}: {engine} holds other weights than the trainer's forward uses: {shown} (sha256 of "
            f"what each side multiplies by{how}). The engine would sample from another policy, so the run stops")
