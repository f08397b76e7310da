"""The layers every architecture is built from: Linear, RMSNorm, HeadRMSNorm, sigmoid_gate.

Each computes through `Ops` (models/ops.py), so a model written with them never looks at
the kernel mode. `Linear` is also where a model meets the engine's weight handling: the
engine prepares a weight once per load (`prepare_for_engine`) or holds it quantized
(`load_quantized`); the trainer does neither and gets the same bits.

What the engine prepares is listed by `engine_operands`, one walk both sides run: the engine
to set its prepared copies, the trainer to hash what the engine should hold after a sync
(titan_rl.quant_weights.trainer_digests); `held_operands` is the engine's own account of what
it holds, hashed by its weight checksum (TitanForCausalLM.weight_digests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from titan_rl.kernels import gemm_weight, lm_head_weight
from titan_rl.kernels.quant.gemm import PackedQuant, quant_linear, quant_operands, uses_quant_gemm
from titan_rl.kernels.quant.recipes import QuantLayer
from titan_rl.models.ops import Ops

# (layer_index, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]: the row-mixing op
# each engine passes in (the trainer's dense causal attention, vLLM's paged one).
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Linear -> its weight as one side has it: a dense tensor or a kernels.quant.QuantizedWeight
# (the engine's own: `held`; the trainer's: the state of a sync, by parameter name)
WeightSource = Callable[["Linear"], object]

# the name of the LM head's prepared operand (the engine wrapper holds it, not a module)
LM_HEAD_OPERAND = "lm_head.prepared"


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in fp32, round to x's dtype, scale by the weight.
    `offset=True`: Qwen3-Next / Qwen3.5's zero-centred form, normalised x times (1 + w) in
    fp32 and rounded once (the kernel run on fp32 x with the fp32 weight 1 + w)."""

    def __init__(self, dim: int, eps: float, ops: Ops, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.ops, self.offset = eps, ops, offset

    def operands(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, weight) as the kernel takes them (the output is cast back to x's dtype)."""
        return (x.float(), 1.0 + weight.float()) if self.offset else (x, weight)

    def forward(self, x):
        return self.ops.rms_norm(*self.operands(x, self.weight), self.eps).to(x.dtype)


class HeadRMSNorm(RMSNorm):
    """RMSNorm of per-head vectors [..., H, D] by one weight shared by the heads (q_norm,
    k_norm): Ops.head_rms_norm."""

    def forward(self, x):
        return self.ops.head_rms_norm(*self.operands(x, self.weight), self.eps).to(x.dtype)


def sigmoid_gate(ops: Ops, gate: torch.Tensor) -> torch.Tensor:
    """sigmoid(gate) in the gate's dtype (computed in fp32, rounded once, as torch does): the
    output gates of gated attention and of a shared expert."""
    return ops.elementwise(torch.sigmoid, gate.float()).to(gate.dtype)


class Linear(nn.Module):
    """nn.Linear's parameter layout (weight [out, in], no bias) over the kernel linear.
    `kind`: "col" (output columns split under TP), "row" (reduction dim split) or
    "plain"; see Ops.linear_for. `group`: the quantization layer group it belongs to
    (None: never quantized); `recipe` is what Ops says that group runs."""

    KINDS = ("plain", "col", "row")

    def __init__(self, d_in: int, d_out: int, ops: Ops, kind: str = "plain", group: QuantLayer | None = None):
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"Linear kind = {kind!r}; allowed: {self.KINDS}")
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.ops, self.kind, self.shape = ops, kind, (d_out, d_in)
        self.recipe = ops.recipe_for(group)
        self.quant_input = False
        if self.recipe is not None:
            from titan_rl.kernels.quant import check_linear_shape, quantizes_activations

            check_linear_shape(self.recipe, d_out, d_in)
            self.quant_input = quantizes_activations(self.recipe)
        self.gemm_weight = None  # engine: `weight` prepared for the GEMM (prepare_for_engine)
        self.qweight = None  # engine: the weight as payload + scales (load_quantized; `weight` is then None)
        # engine, quantized GEMM: (the PackedQuant its forward reads, its first row there, its
        # last + 1): its own, or its share of a fused [q; k; v] / [gate; up]
        self.packed_rows = None

    @property
    def out_rows(self) -> int:
        """Rows of the weight this module holds (its own slice under the engine's TP)."""
        return (self.weight if self.weight is not None else self.qweight.payload).shape[0]

    def operand_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input the GEMM sees: per-row fake-quantized when the recipe quantizes inputs."""
        if not self.quant_input:
            return x
        from titan_rl.kernels.quant import fake_quantize

        return fake_quantize(x, self.recipe, "activation")

    def operand_weight(self) -> torch.Tensor:
        """The weight the GEMM sees: the held payload dequantized (engine), the master
        fake-quantized (trainer), or the weight itself (no recipe)."""
        return dense_operand(held(self), self.recipe)

    def forward(self, x):
        fn = self.ops.linear_for(self.kind)
        if self.gemm_weight is not None and fn is self.ops.linear:
            if isinstance(self.gemm_weight, PackedQuant):  # the engine's quantized GEMM (kernels/quant/gemm.py)
                return quant_linear(x, self.gemm_weight)
            return fn(self.operand_input(x), self.gemm_weight)
        if self.recipe is not None:
            if fn is self.ops.linear and uses_quant_gemm(self.recipe, x.dtype, x.device):
                return quant_linear(x, quant_operands([self]), self.recipe)
            return fn(self.operand_input(x), self.operand_weight())
        return fn(x, self.weight)

    # -- the engine's side -----------------------------------------------------------------
    PREPARED = ("gemm_weight",)  # the attributes engine_operands sets (held_operands reads them)

    def engine_operands(self, source: WeightSource) -> tuple[dict, list[nn.Module]]:
        """The weight prepared for the GEMM (`prepared_weight`; the trainer prepares it per
        call: the same bits), and the modules it covers."""
        return {"gemm_weight": prepared_weight([self], source)}, [self]

    def held_weight(self) -> torch.Tensor:
        """The engine's weight as its forward multiplies by it (for the post-sync checksum):
        read back from the packed bytes the quantized GEMM reads, else the held payload
        dequantized, else the parameter."""
        if self.packed_rows is not None:
            from titan_rl.kernels.quant import dequantize

            pq, start, stop = self.packed_rows
            return dequantize(*pq.unpack(start, stop), self.recipe, self.qweight.dtype)
        if self.qweight is not None:
            return self.qweight.dense()
        return self.weight.detach()

    def load_quantized(self, name: str, tensor, dtype: torch.dtype) -> None:
        """Hold the weight as payload + scales (a kernels.quant.QuantizedWeight); the dense
        parameter is dropped (the memory the recipe saves). A dense tensor is quantized
        here, by the trainer's function."""
        from titan_rl.kernels.quant import QuantizedWeight

        if isinstance(tensor, torch.Tensor):
            if tuple(tensor.shape) != self.shape:
                raise ValueError(f"checkpoint key {name!r}: expected shape {self.shape}, found {tuple(tensor.shape)}")
            tensor = QuantizedWeight.of(tensor.to(dtype), self.recipe)
        if tensor.recipe != self.recipe or tensor.dtype != dtype:
            raise ValueError(f"checkpoint key {name!r}: a {tensor.recipe} weight of {tensor.dtype}; this engine "
                             f"runs {self.recipe} in {dtype}")
        # the engine's own copy: what it holds is never the sender's tensor
        self.packed_rows = None  # until prepare_for_engine packs the new payload
        self.qweight = QuantizedWeight(tensor.recipe, tensor.payload.clone(), tuple(s.clone() for s in tensor.scales),
                                       tensor.dtype)
        self.weight = None


def held(m: Linear):
    """The engine's WeightSource: the QuantizedWeight m holds, else its parameter."""
    return m.qweight if m.qweight is not None else m.weight


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


def prepared_weight(mods: list[Linear], source: WeightSource):
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


def fused_operands(attr: str, mods: list[Linear], source: WeightSource) -> tuple[dict, list[nn.Module]]:
    """({attr: one prepared weight for mods}, mods) for modules that read the same input (q/k/v,
    gate/up: Ops.same_input fuses them); ({}, []) where they do not fuse (each then prepares its own)."""
    if not mods[0].ops.fuse_same_input or mods[0].ops.tp_leaves:
        return {}, []
    return {attr: prepared_weight(mods, source)}, mods


@dataclass
class Prepared:
    """One operand the engine prepares once per load: set as `module.attr` (module None: the
    LM head's, which the engine wrapper holds), covering the Linears `covers`."""

    name: str  # its name in the weight checksum: "<module name>.<attr>"
    module: nn.Module | None
    attr: str
    operand: object
    covers: list


def lm_head_operand(model: nn.Module, source: WeightSource = held):
    """The LM head's weight prepared once per load for lm_head_logits (kernels.lm_head_weight)."""
    return lm_head_weight(source(model.lm_head).detach())


def engine_operands(model: nn.Module, source: WeightSource) -> Iterator[Prepared]:
    """Every operand the engine prepares once per weight load, computed now from the weights
    `source` gives, one at a time, outermost module first: a module that prepares its
    children's weights itself (Attention's fused q/k/v) covers them. TP pieces (tp_leaves > 0)
    slice their weights per call: only the LM head is prepared. The engine runs this on what
    it holds (prepare_for_engine), the trainer on what it sends: the same code, so the same
    operands where both start from the same weights."""
    if not model.ops.tp_leaves:
        done = {id(model.lm_head)}
        for name, m in model.named_modules():
            if m is not model and id(m) not in done and hasattr(m, "engine_operands"):
                operands, covers = m.engine_operands(source)
                done.update(id(c) for c in covers)
                for attr, op in operands.items():
                    yield Prepared(f"{name}.{attr}", m, attr, op, covers)
    yield Prepared(LM_HEAD_OPERAND, None, "", lm_head_operand(model, source), [])


def held_operands(model: nn.Module) -> Iterator[tuple[str, object]]:
    """(name, operand) of each prepared operand a model's modules hold now (the engine's own
    account: read from the attributes its forward reads, not derived), under the names
    engine_operands gives. The LM head's is the engine wrapper's to add."""
    for name, m in model.named_modules():
        for attr in getattr(type(m), "PREPARED", ()):
            op = getattr(m, attr)
            if op is not None:
                yield f"{name}.{attr}", op


def prepare_for_engine(model: nn.Module):
    """Each operand of engine_operands, from the weights the engine holds (`held`), set where
    its forward reads it, once per weight load (stale copies cleared first). Returns the LM
    head's (the engine wrapper holds it; it is not computed by a module's forward)."""
    for m in model.modules():
        for attr in getattr(type(m), "PREPARED", ()):
            setattr(m, attr, None)
    head = None
    for p in engine_operands(model, held):
        if p.module is None:
            head = p.operand
            continue
        setattr(p.module, p.attr, p.operand)
        if isinstance(p.operand, PackedQuant):  # each covered Linear's rows there (its held_weight)
            start = 0
            for c in p.covers:
                c.packed_rows = (p.operand, start, start + c.out_rows)
                start += c.out_rows
    return head
