"""Quantization recipes: one quantize / dequantize pair per recipe (docs/quantization.md).

  quantize(x, recipe, role) -> (payload, scales)   payload in the recipe's storage dtype,
                                                   scales a tuple of tensors
  dequantize(payload, scales, recipe, dtype)       back to a dense tensor of `dtype`
  fake_quantize(x, recipe, role)                   dequantize(quantize(x)) in x's dtype, with
                                                   a straight-through gradient
  QuantizedWeight.of(w, recipe)                    what the engine holds for a weight: payload
                                                   + scales; .dense(dtype) = fake_quantize(w)
  quantizes_activations(recipe), check_linear_shape(recipe, d_out, d_in)

reference.py is the plain definition of each recipe, torch_impl.py the functions both
engines call (torchao's primitives; what torchao lacks is hand-written there, with why).
torch_impl is imported on first use: reading a config imports this package for the
recipe names, and importing torchao costs seconds and logs warnings on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titan_rl.kernels.quant.recipes import (
    QUANT_LAYERS, QUANT_RECIPES, ROLES, ActivationScale, QuantLayer, QuantRecipe, Role, Scales,
    check_activation_scale,
)

if TYPE_CHECKING:
    from titan_rl.kernels.quant.torch_impl import RecipeImpl

__all__ = [
    "QUANT_LAYERS", "QUANT_RECIPES", "ROLES", "ActivationScale", "QuantLayer", "QuantRecipe", "Role", "Scales",
    "QuantizedWeight", "check_activation_scale", "check_linear_shape", "dequantize", "fake_quantize", "quantize",
    "quantizes_activations",
]


def _impl(recipe: str) -> RecipeImpl:
    from titan_rl.kernels.quant.torch_impl import RECIPES

    if recipe == "none":
        raise ValueError("recipe = 'none' quantizes nothing; call the layer on its own weights")
    if recipe not in RECIPES:
        raise ValueError(f"recipe = {recipe!r} is not allowed; allowed: {list(QUANT_RECIPES)}")
    return RECIPES[recipe]


@torch.no_grad()
def quantize(x: torch.Tensor, recipe: QuantRecipe, role: Role, *,
             activation_scale: ActivationScale = "row") -> tuple[torch.Tensor, Scales]:
    """(payload, scales) of a 2D tensor [rows, K]. `role` picks the scale layout
    (docs/quantization.md); `activation_scale` = "tensor" is refused (check_activation_scale)."""
    from titan_rl.kernels.quant.torch_impl import check_blocks

    impl = _impl(recipe)
    if role not in ROLES:
        raise ValueError(f"role = {role!r} is not allowed; allowed: {list(ROLES)}")
    if role == "weight":
        check_blocks(x, recipe, role, impl.weight_block)
        return impl.quantize_weight(x)
    check_activation_scale(activation_scale)
    if impl.quantize_activation is None:
        raise ValueError(f"recipe {recipe!r} quantizes weights only (activations stay in their dtype); "
                         f"'nvfp4_w4a4' also quantizes activations")
    check_blocks(x, recipe, role, impl.activation_block)
    return impl.quantize_activation(x)


@torch.no_grad()
def dequantize(payload: torch.Tensor, scales: Scales, recipe: QuantRecipe, dtype: torch.dtype) -> torch.Tensor:
    """The dense tensor of `dtype` that (payload, scales) stand for (scale layout read from the shapes)."""
    return _impl(recipe).dequantize(payload, scales, dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: the fake-quantized tensor, bit for bit; backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, x, recipe, role):
        return _fake_quantize_values(x, recipe, role)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _fake_quantize_values(x: torch.Tensor, recipe: QuantRecipe, role: Role) -> torch.Tensor:
    """The fake-quantized values, no gradient (called without one: the engine, or inside
    _StraightThrough.forward). Per call on every quantized linear: kept lean."""
    impl = _impl(recipe)
    fused = impl.fake_quantize_weight if role == "weight" else impl.fake_quantize_activation
    if fused is not None and role in ROLES and x.device.type == "cpu":  # the compiled forms run on CPU
        impl.check(x, recipe, role)
        return fused(x)
    payload, scales = quantize(x, recipe, role)
    return dequantize(payload, scales, recipe, x.dtype)


def fake_quantize(x: torch.Tensor, recipe: QuantRecipe, role: Role) -> torch.Tensor:
    """dequantize(quantize(x, recipe, role), recipe, x.dtype); gradients pass straight through.
    Without a gradient to carry (the engine, no_grad) the autograd Function is skipped:
    its per-call overhead is most of a decode-sized call."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _StraightThrough.apply(x, recipe, role)
    return _fake_quantize_values(x, recipe, role)


def quantizes_activations(recipe: QuantRecipe) -> bool:
    """True when the recipe quantizes a linear's input too (False: weight-only, e.g. nvfp4)."""
    return _impl(recipe).quantize_activation is not None


def check_linear_shape(recipe: QuantRecipe, d_out: int, d_in: int) -> None:
    """A ValueError naming the shape and the block when a linear's weight [d_out, d_in] (or
    its input rows [*, d_in], for a recipe that quantizes them) does not tile into the
    recipe's blocks: found when the model is built, before any weight exists."""
    impl = _impl(recipe)
    (wr, wk), (_, ak) = impl.weight_block, impl.activation_block
    if d_out % wr or d_in % wk:
        raise ValueError(f"{recipe} quantizes weights in blocks of {wr}x{wk} (rows x K); a [{d_out}, {d_in}] "
                         "linear does not divide into them")
    if impl.quantize_activation is not None and d_in % ak:
        raise ValueError(f"{recipe} quantizes activations in blocks of {ak} along K; a linear with {d_in} "
                         "inputs does not divide into them")


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight as the engine holds it: payload in the recipe's storage dtype + scales, and
    the dtype of the weight it came from (the one the GEMM computes in)."""

    recipe: QuantRecipe
    payload: torch.Tensor
    scales: Scales
    dtype: torch.dtype

    @classmethod
    def of(cls, w: torch.Tensor, recipe: QuantRecipe) -> "QuantizedWeight":
        payload, scales = quantize(w.detach(), recipe, "weight")
        return cls(recipe, payload, scales, w.dtype)

    def dense(self) -> torch.Tensor:
        """The dense weight the GEMM multiplies by: fake_quantize(w) of the weight it came from."""
        return dequantize(self.payload, self.scales, self.recipe, self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.payload, *self.scales))

    def tensors(self) -> dict[str, torch.Tensor]:
        """{"payload": ..., "scale0": ..., ...}: what a checksum or a byte count reads."""
        return {"payload": self.payload, **{f"scale{i}": s for i, s in enumerate(self.scales)}}
