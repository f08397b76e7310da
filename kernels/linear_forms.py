"""A Linear's form: how it multiplies, chosen once per load, not branched on per call.

A `Linear` (models/layers.py) holds its parameter and one form; `forward` is `form.linear`.
The trainer's build sets the form from the layer's recipe (`form_for`: the master as it is, or
fake-quantized); the engine's load replaces it when it holds the weight as payload + scales
(`Quantized` with `held`), and its preparation wraps that base form once per weight load in a
form that reads an operand prepared for the GEMM (`Prepared`: this Linear's own; `Member`: its
rows of one operand prepared for several Linears that read one input, q/k/v or gate/up;
`Heads`: GLM-5's per-head weights of the absorbed attention). A prepared form gives back its
base (`base`) when the weights change, so stale operands cannot outlive a load.

All of the quantization a model's layers do is here: fake quantization of the trainer's
masters and inputs, the quantized GEMM's operands (`quant_operands`, `prepared_weight`) and
the fused GEMM of Linears that read one input (`fused_linear`), beside kernels/quant.
vLLM's analogue is a layer's `quant_method`, chosen at construction; gpt-fast swaps the module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from titan_rl.kernels import gemm_weight
from titan_rl.kernels.quant.gemm import PackedQuant, quant_linear, quant_operands, uses_quant_gemm


class Form:
    """The dense master, multiplied as it is: the trainer's and the engine's form of a Linear
    with no recipe (the base every other form refines)."""

    @property
    def base(self) -> "Form":
        """The form before the engine's preparation (a load's weights are prepared from it)."""
        return self

    @property
    def held(self):
        """The weight as the engine holds it, when payload + scales (kernels.quant.QuantizedWeight)."""
        return None

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """The input the GEMM sees."""
        return x

    def weight(self, lin) -> torch.Tensor:
        """The dense weight the GEMM multiplies by (the trainer's: gradients flow to the master)."""
        return lin.weight

    def source(self, lin):
        """The weight as this side has it: the held QuantizedWeight, else the parameter (a
        layers.WeightSource's answer for the engine)."""
        return lin.weight

    def linear(self, lin, x: torch.Tensor, fn) -> torch.Tensor:
        """y = x @ W^T by `fn` (Ops.linear_for the Linear's kind)."""
        return fn(x, lin.weight)

    def packed_rows(self):
        """(the PackedQuant the quantized GEMM reads, first row, last + 1) of this Linear's
        weight, where its form reads one; else None."""
        return None

    def prepared(self) -> Iterator[tuple[str, object]]:
        """(name, operand) of what this form reads that the engine prepared once per load."""
        return iter(())


class Quantized(Form):
    """A Linear of a quantization recipe: the trainer's master fake-quantized (its own code
    path, gradients straight through), or the engine's payload + scales (`held`) dequantized;
    the recipe's quantized GEMM where it runs (uses_quant_gemm), on either."""

    def __init__(self, recipe: str, held=None):
        from titan_rl.kernels.quant import quantizes_activations

        self.recipe, self._held = recipe, held
        self.quant_input = quantizes_activations(recipe)

    @property
    def held(self):
        return self._held

    def input(self, x):
        if not self.quant_input:
            return x
        from titan_rl.kernels.quant import fake_quantize

        return fake_quantize(x, self.recipe, "activation")

    def weight(self, lin):
        if self._held is not None:
            return self._held.dense()
        from titan_rl.kernels.quant import fake_quantize

        return fake_quantize(lin.weight, self.recipe, "weight")

    def source(self, lin):
        return self._held if self._held is not None else lin.weight

    def linear(self, lin, x, fn):
        if fn is lin.ops.linear and uses_quant_gemm(self.recipe, x.dtype, x.device):
            return quant_linear(x, quant_operands([lin]), self.recipe)
        return fn(self.input(x), self.weight(lin))


def form_for(recipe: str | None) -> Form:
    """The form a Linear is built with: the trainer's, and the engine's until its load."""
    return Form() if recipe is None else Quantized(recipe)


class _Refined(Form):
    """A form the engine's preparation wrapped around a base form (input, weight and source
    are the base's)."""

    def __init__(self, name: str, operand, base: Form):
        self.name, self.operand, self._base = name, operand, base

    @property
    def base(self):
        return self._base

    @property
    def held(self):
        return self._base.held

    def input(self, x):
        return self._base.input(x)

    def weight(self, lin):
        return self._base.weight(lin)

    def source(self, lin):
        return self._base.source(lin)

    def linear(self, lin, x, fn):
        return self._base.linear(lin, x, fn)

    def prepared(self):
        yield self.name, self.operand


class Prepared(_Refined):
    """The engine's: this Linear's weight prepared once for the GEMM (the layout the kernel
    reads, or the quantized GEMM's packed payload + scales); its forward multiplies by it where
    the kind's linear is the plain one (TP pieces slice the weight per call: the base form)."""

    def linear(self, lin, x, fn):
        if fn is not lin.ops.linear:
            return self._base.linear(lin, x, fn)
        if isinstance(self.operand, PackedQuant):
            return quant_linear(x, self.operand)
        return fn(self._base.input(x), self.operand)

    def packed_rows(self):
        return (self.operand, 0, self.operand.n) if isinstance(self.operand, PackedQuant) else None


@dataclass
class Fused:
    """One operand prepared for several Linears that read one input ([q; k; v], [gate; up]):
    `fused_linear` multiplies them at once by it."""

    name: str
    operand: object
    members: list = field(default_factory=list)


class Member(_Refined):
    """The engine's: rows [start, stop) of a Fused operand (its Linear called alone multiplies
    by its base form)."""

    def __init__(self, fused: Fused, start: int, stop: int, base: Form):
        super().__init__(fused.name, fused.operand, base)
        self.fused, self.start, self.stop = fused, start, stop

    def packed_rows(self):
        return (self.operand, self.start, self.stop) if isinstance(self.operand, PackedQuant) else None


class Heads(_Refined):
    """The engine's: per-head weights prepared from this Linear's (GLM-5's absorbed MLA reads
    them instead of calling the Linear): `operand` {"w_uk_t": [...], "w_uv": [...]}."""


def held_weight(lin) -> torch.Tensor:
    """The engine's weight as its forward multiplies by it (for the post-sync checksum): read
    back from the packed bytes the quantized GEMM reads, else the held payload dequantized,
    else the parameter."""
    rows = lin.form.packed_rows()
    if rows is not None:
        from titan_rl.kernels.quant import dequantize

        pq, start, stop = rows
        return dequantize(*pq.unpack(start, stop), lin.recipe, lin.form.held.dtype)
    held = lin.form.held
    return held.dense() if held is not None else lin.weight.detach()


# -- the operands the engine prepares -------------------------------------------------------

def dense_operand(w, recipe) -> torch.Tensor:
    """The dense weight a GEMM multiplies by, of a weight as a WeightSource gives it: a
    QuantizedWeight dequantized, a master fake-quantized (gradients flow straight through),
    a weight with no recipe as it is."""
    from titan_rl.kernels.quant import QuantizedWeight, fake_quantize

    if isinstance(w, QuantizedWeight):
        return w.dense()
    return w if recipe is None else fake_quantize(w, recipe, "weight")


def _dtype_device(w) -> tuple[torch.dtype, torch.device]:
    """The dtype a weight's GEMM computes in and its device (a QuantizedWeight: its source's dtype)."""
    return (w.dtype, w.payload.device) if hasattr(w, "payload") else (w.dtype, w.device)


def prepared_weight(mods: list, source: Callable):
    """THE preparation of the GEMM operand of Linear modules that read one input (one module,
    or a fused [q; k; v] / [gate; up]), from their weights as `source` gives them. A recipe
    that runs the quantized GEMM (`uses_quant_gemm`) packs the payloads + scales, each weight
    quantized on its own (no dense copy: the GEMM reads the payload); otherwise the dense
    operands (dequantized once here: the values the trainer's fake-quantized master gives) in
    the GEMM's prepared layout."""
    ws, recipe = [source(m) for m in mods], mods[0].recipe
    if recipe is not None and uses_quant_gemm(recipe, *_dtype_device(ws[0])):
        return PackedQuant.of_weights(recipe, ws)
    dense = [dense_operand(w, recipe).detach() for w in ws]
    return gemm_weight(dense[0] if len(dense) == 1 else torch.cat(dense))


@dataclass
class Operand:
    """One operand the engine prepares once per load, as a module's engine_operands gives
    it: `attr` names it in the weight checksum ("<module name>.<attr>"), `covers` are the
    Linears whose forms read it, `install(name, operand, covers)` sets those forms."""

    attr: str
    operand: object
    covers: list
    install: Callable | None = None


def own_operand(lin, source) -> list[Operand]:
    """A Linear's weight prepared for the GEMM (the trainer prepares it per call: the same bits)."""
    def install(name, operand, covers):
        lin.form = Prepared(name, operand, lin.form)

    return [Operand("gemm_weight", prepared_weight([lin], source), [lin], install)]


def fused_operands(attr: str, mods: list, source) -> list[Operand]:
    """One operand prepared for Linears that read the same input (q/k/v, gate/up: Ops.same_input
    fuses them); none where they do not fuse (each then prepares its own)."""
    if not mods[0].ops.fuse_same_input or mods[0].ops.tp_leaves:
        return []

    def install(name, operand, covers):
        fused, start = Fused(name, operand, list(covers)), 0
        for m in covers:
            m.form = Member(fused, start, start + m.out_rows, m.form)
            start += m.out_rows

    return [Operand(attr, prepared_weight(mods, source), list(mods), install)]


def heads_operand(attr: str, lin, heads: dict) -> list[Operand]:
    """Per-head weights prepared from `lin`'s, read instead of calling it (GLM-5's absorbed MLA)."""
    def install(name, operand, covers):
        lin.form = Heads(name, operand, lin.form)

    return [Operand(attr, heads, [lin], install)]


def untouched(*mods) -> list[Operand]:
    """Linears a module multiplies by itself, per call, with nothing prepared (a router's
    weight): they are covered so that no own operand is made for them."""
    return [Operand("", None, list(mods))]


def fused_linear(x: torch.Tensor, mods: list, linear) -> torch.Tensor:
    """mods' outputs on x, concatenated, as ONE GEMM by `linear` (Ops.same_input): the
    engine's Fused operand where its preparation made one for exactly these mods, else the
    weights concatenated per call (the trainer; the same bits). Quantized mods (one group, so
    one recipe): each weight quantized on its own (a per-tensor scale must not span q, k and
    v), the input once."""
    form, recipe = mods[0].form, mods[0].recipe
    fused = form.fused if isinstance(form, Member) else None
    if fused is not None and fused.members == list(mods):
        if isinstance(fused.operand, PackedQuant):
            return quant_linear(x, fused.operand, recipe)
        return linear(form.input(x), fused.operand)
    if recipe is not None and uses_quant_gemm(recipe, x.dtype, x.device):
        return quant_linear(x, quant_operands(mods), recipe)
    return linear(form.input(x), torch.cat([m.form.weight(m) for m in mods]))
