"""The quantization recipes' names, the layer groups a recipe can cover, the types the
quantizers share.

Kept free of torchao so that reading a config does not import it. docs/quantization.md
says what each recipe stores and which torchao config it corresponds to.
"""

from __future__ import annotations

import typing
from typing import Literal

import torch

QuantRecipe = Literal["none", "fp8_rowwise", "fp8_block", "mxfp8", "nvfp4", "nvfp4_w4a4"]
QUANT_RECIPES: tuple[str, ...] = typing.get_args(QuantRecipe)

# A quantized tensor's scales, by recipe: (fp32 scales,) for fp8, (E8M0 scales,) for mxfp8,
# (e4m3 block scales, fp32 global scale) for nvfp4.
Scales = tuple[torch.Tensor, ...]

# A tensor's role decides its scale layout: a weight is fixed between syncs and may share
# a scale across rows (fp8_block's 128x128 tiles, nvfp4's per-tensor scale); an
# activation row is one token, so its scales come from that row alone.
Role = Literal["weight", "activation"]
ROLES: tuple[str, ...] = typing.get_args(Role)

# How an activation's dynamic scale is reduced: "row" = over the row's own elements (the
# whole row, or each block of it, as the recipe says); "tensor" = over the whole batch,
# which exact mode refuses (check_activation_scale).
ActivationScale = Literal["row", "tensor"]

# The decoder's linears a recipe covers. Embeddings, the LM head, the MoE router and the
# GDN gates (in_proj_ba) are never quantized (docs/quantization.md says why).
QuantLayer = Literal["attention", "mlp", "experts", "linear_attention"]
QUANT_LAYERS: tuple[str, ...] = typing.get_args(QuantLayer)

# kernels = "stock" with a recipe: vLLM's own online quantization samples, against a plain
# high-precision trainer (the baseline a normal stack runs). vLLM's quantization="fp8" does
# not run on its CPU build (docs/quantization.md shows the error), so the stock engine
# runs vLLM's torchao path with torchao's FP8 weight-only config, the FP8 that does.
STOCK_QUANTIZATION: dict[str, str] = {"fp8_rowwise": "Float8WeightOnlyConfig"}


def check_activation_scale(value: object) -> ActivationScale:
    """`value` if an activation may be scaled that way in exact mode; a ValueError otherwise."""
    if value == "tensor":
        raise ValueError(
            "activation_scale = 'tensor': a per-tensor dynamic activation scale is the amax over every "
            "row in the batch, so a row's quantized bits would depend on its neighbours (the other "
            "requests scheduled with it); exact mode refuses it. Use 'row' (scales from the row's own "
            "elements: per row, or per block of the row)")
    if value != "row":
        allowed = list(typing.get_args(ActivationScale))
        raise ValueError(f"activation_scale = {value!r} is not allowed; allowed: {allowed}")
    return "row"


# -- the recipes' refusals, for every caller (the config, parity's CLI, the engine) ----------

def check_stock_recipe(recipe: str, *, recipe_key: str = "quantization.recipe",
                       kernels_key: str = "model.kernels = 'stock'") -> None:
    """With vLLM's stock engine only the recipes it runs online (STOCK_QUANTIZATION)."""
    if recipe != "none" and recipe not in STOCK_QUANTIZATION:
        raise ValueError(f"{recipe_key} = {recipe!r} with {kernels_key}: vLLM's stock engine has no online form of "
                         f"it; allowed with stock kernels: {['none', *STOCK_QUANTIZATION]} (vLLM's torchao FP8 "
                         "weight-only quantization)")


def check_tp_recipe(key: str, tp: int, recipe: str, recipe_key: str = "quantization.recipe", hint: str = "") -> None:
    """No recipe at a tensor-parallel degree `tp` > 1 (the key `key`): a quantized weight is
    held whole, its scales per row / block of the full tensor."""
    if tp > 1 and recipe != "none":
        short = key.rsplit(".", 1)[-1]
        raise ValueError(f"{recipe_key} = {recipe!r} with {key} = {tp}: a sharded weight's scales would be taken "
                         f"over its shard (a quantized weight is held whole, its scales per row / block of the full "
                         f"tensor); allowed: {short} = 1" + (f" ({hint})" if hint else ""))
