"""ModelOptions: how a model computes, as opposed to what it is (its architecture config).

One value travels unchanged from the config ([model] kernels / tp_leaves, [quantization])
through TorchTitan's model config and the checkpoint folder's config.json to `Ops`
(models/ops.py), which is the only reader that acts on it:

  kernels       "exact" (batch-invariant kernels: trainer == engine, bit for bit) or "stock"
  tp_leaves     0, or L (a power of two): column-parallel linears run as L fixed column
                blocks and row-parallel ones as L K-leaves summed by a fixed tree, so TP = 1,
                2, ..., L and the engine give the same bits (exact mode)
  quantization  the recipe the decoder linears of `layers` run (docs/quantization.md)

config.json carries the last two as "titan_tp_leaves" / "titan_quantization" (transformers
keeps unknown keys as attributes), so the engine builds what the trainer built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_rl.kernels.mode import KernelMode, check_kernels
from titan_rl.kernels.quant.recipes import QUANT_LAYERS, QUANT_RECIPES, QuantLayer, QuantRecipe


@dataclass(frozen=True)
class Quantization:
    recipe: QuantRecipe = "none"
    layers: tuple[QuantLayer, ...] = QUANT_LAYERS


@dataclass(frozen=True)
class ModelOptions:
    kernels: KernelMode = "exact"
    tp_leaves: int = 0
    quantization: Quantization = field(default_factory=Quantization)

    def validate(self) -> ModelOptions:
        check_kernels(self.kernels)
        L = self.tp_leaves
        if L < 0 or L & (L - 1):
            raise ValueError(f"model.tp_leaves = {L} must be 0 or a power of two")
        q = self.quantization
        if q.recipe not in QUANT_RECIPES:
            raise ValueError(f"quantization.recipe = {q.recipe!r} is not allowed; allowed: {list(QUANT_RECIPES)}")
        bad = [g for g in q.layers if g not in QUANT_LAYERS]
        if bad:
            raise ValueError(f"quantization.layers = {list(q.layers)}: {bad} not allowed; allowed: {list(QUANT_LAYERS)}")
        return self

    def check_widths(self, widths: dict[str, int]) -> None:
        """tp_leaves must divide each width the leaf pieces split ({name for the error: width})."""
        L = self.tp_leaves
        for name, n in widths.items():
            if L and n % L:
                raise ValueError(f"model.tp_leaves = {L} must divide {name} = {n}")

    # -- config.json ---------------------------------------------------------------------
    def to_hf(self) -> dict:
        """The config.json keys of the options that change the engine's bits (only when set)."""
        d: dict = {}
        if self.tp_leaves > 0:
            d["titan_tp_leaves"] = self.tp_leaves
        if self.quantization.recipe != "none":
            d["titan_quantization"] = {"recipe": self.quantization.recipe, "layers": list(self.quantization.layers)}
        return d

    @classmethod
    def from_hf(cls, d: dict, kernels: KernelMode = "exact") -> ModelOptions:
        quant = d.get("titan_quantization") or {}
        return cls(kernels=kernels, tp_leaves=int(d.get("titan_tp_leaves") or 0),
                   quantization=Quantization(quant.get("recipe", "none"), tuple(quant.get("layers", QUANT_LAYERS)))
                   ).validate()
