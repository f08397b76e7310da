"""The layers every architecture is built from: Linear, RMSNorm, HeadRMSNorm, sigmoid_gate.

Each computes through `Ops` (models/ops.py), so a model written with them never looks at
the kernel mode. `Linear` is also where a model meets the engine's weight handling, through
its form (kernels/linear_forms.py): the engine holds a weight quantized (`load_quantized`) and
prepares it once per load (`prepare_for_engine`); the trainer does neither and gets the same bits.

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

from titan_rl.kernels import lm_head_weight
from titan_rl.kernels.quant.recipes import QuantLayer
from titan_rl.kernels import linear_forms as forms
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
    (None: never quantized); `recipe` is what Ops says that group runs. How it multiplies is
    its `form` (kernels/linear_forms.py), chosen once: at build from the recipe, by the engine at
    each load."""

    KINDS = ("plain", "col", "row")

    def __init__(self, d_in: int, d_out: int, ops: Ops, kind: str = "plain", group: QuantLayer | None = None):
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"Linear kind = {kind!r}; allowed: {self.KINDS}")
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.ops, self.kind, self.shape = ops, kind, (d_out, d_in)
        self.recipe = ops.recipe_for(group)
        if self.recipe is not None:
            from titan_rl.kernels.quant import check_linear_shape

            check_linear_shape(self.recipe, d_out, d_in)
        self.form = forms.form_for(self.recipe)

    def forward(self, x):
        return self.form.linear(self, x, self.ops.linear_for(self.kind))

    @property
    def qweight(self):
        """The engine's weight as payload + scales (a kernels.quant.QuantizedWeight), or None."""
        return self.form.held

    @property
    def packed_rows(self):
        """(the PackedQuant its form reads, its first row there, its last + 1), or None."""
        return self.form.packed_rows()

    @property
    def out_rows(self) -> int:
        """Rows of the weight this module holds (its own slice under the engine's TP)."""
        return (self.weight if self.weight is not None else self.qweight.payload).shape[0]

    def operand_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input the GEMM sees: per-row fake-quantized when the recipe quantizes inputs."""
        return self.form.input(x)

    def operand_weight(self) -> torch.Tensor:
        """The weight the GEMM sees: the held payload dequantized (engine), the master
        fake-quantized (trainer), or the weight itself (no recipe)."""
        return self.form.weight(self)

    # -- the engine's side -----------------------------------------------------------------
    def engine_operands(self, source: WeightSource) -> list[forms.Operand]:
        """The weight prepared for the GEMM (forms.prepared_weight; the trainer prepares it
        per call: the same bits)."""
        return forms.own_operand(self, source)

    def held_weight(self) -> torch.Tensor:
        """The engine's weight as its forward multiplies by it (forms.held_weight)."""
        return forms.held_weight(self)

    def load_quantized(self, name: str, tensor, dtype: torch.dtype) -> None:
        """Hold the weight as payload + scales (a kernels.quant.QuantizedWeight): the form
        becomes forms.Quantized over the engine's own copy; the dense parameter is dropped
        (the memory the recipe saves). A dense tensor is quantized here, by the trainer's
        function."""
        from titan_rl.kernels.quant import QuantizedWeight

        if isinstance(tensor, torch.Tensor):
            if tuple(tensor.shape) != self.shape:
                raise ValueError(f"checkpoint key {name!r}: expected shape {self.shape}, found {tuple(tensor.shape)}")
            tensor = QuantizedWeight.of(tensor.to(dtype), self.recipe)
        if tensor.recipe != self.recipe or tensor.dtype != dtype:
            raise ValueError(f"checkpoint key {name!r}: a {tensor.recipe} weight of {tensor.dtype}; this engine "
                             f"runs {self.recipe} in {dtype}")
        # the engine's own copy: what it holds is never the sender's tensor (and a prepared
        # form of the old payload is dropped until prepare_for_engine prepares the new one)
        self.form = forms.Quantized(self.recipe, QuantizedWeight(
            tensor.recipe, tensor.payload.clone(), tuple(s.clone() for s in tensor.scales), tensor.dtype))
        self.weight = None


def held(m: Linear):
    """The engine's WeightSource: the QuantizedWeight m holds, else its parameter."""
    return m.form.source(m)


@dataclass
class Prepared:
    """One operand the engine prepares once per load, covering the Linears `covers` (their
    forms read it; `install` sets those forms); install None: the LM head's, which the engine
    wrapper holds."""

    name: str  # its name in the weight checksum: "<module name>.<attr>"
    operand: object
    covers: list
    install: Callable | None


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
                for op in m.engine_operands(source):
                    done.update(id(c) for c in op.covers)
                    if op.operand is not None:
                        yield Prepared(f"{name}.{op.attr}", op.operand, op.covers, op.install)
    yield Prepared(LM_HEAD_OPERAND, lm_head_operand(model, source), [], None)


def held_operands(model: nn.Module) -> Iterator[tuple[str, object]]:
    """(name, operand) of each prepared operand the model's Linears' forms read now (the
    engine's own account: read from what its forward reads, not derived), under the names
    engine_operands gives, each once. The LM head's is the engine wrapper's to add."""
    seen = set()
    for m in model.modules():
        if isinstance(m, Linear):
            for name, op in m.form.prepared():
                if id(op) not in seen:
                    seen.add(id(op))
                    yield name, op


def prepare_for_engine(model: nn.Module):
    """Each operand of engine_operands, from the weights the engine holds (`held`), installed
    in the forms of the Linears that read it, once per weight load (every form back to its
    base first: no stale operand). Returns the LM head's (the engine wrapper holds it; it is
    not computed by a module's forward)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.form = m.form.base
    head = None
    for p in engine_operands(model, held):
        if p.install is None:
            head = p.operand
        else:
            p.install(p.name, p.operand, p.covers)
    return head
