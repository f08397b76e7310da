"""Quantization recipes: one quantize / dequantize pair per recipe (docs/quantization.md).

  quantize(x, recipe, role) -> (payload, scales)   payload in the recipe's storage dtype,
                                                   scales a tuple of tensors
  dequantize(payload, scales, recipe, dtype)       back to a dense tensor of `dtype`
  fake_quantize(x, recipe, role)                   dequantize(quantize(x)) in x's dtype, with
                                                   a straight-through gradient

reference.py is the plain definition of each recipe, torch_impl.py the functions both
engines call (torchao's primitives; what torchao lacks is hand-written there, with why).
torch_impl is imported on first use: reading a config imports this package for the
recipe names, and importing torchao costs seconds and logs warnings on CPU.
"""

from __future__ import annotations

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
    "check_activation_scale", "dequantize", "fake_quantize", "quantize",
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
        payload, scales = quantize(x, recipe, role)
        return dequantize(payload, scales, recipe, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quantize(x: torch.Tensor, recipe: QuantRecipe, role: Role) -> torch.Tensor:
    """dequantize(quantize(x, recipe, role), recipe, x.dtype); gradients pass straight through."""
    return _StraightThrough.apply(x, recipe, role)
