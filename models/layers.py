"""The layers every architecture is built from: Linear, RMSNorm, HeadRMSNorm.

Each computes through `Ops` (models/ops.py), so a model written with them never looks at
the kernel mode. `Linear` is also where a model meets the engine's weight handling: the
engine prepares a weight once per load (`prepare_for_engine`) or holds it quantized
(`load_quantized`); the trainer does neither and gets the same bits.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from titan_rl.kernels import gemm_weight
from titan_rl.kernels.quant.gemm import PackedQuant, quant_linear, quant_operands, uses_quant_gemm
from titan_rl.kernels.quant.recipes import QuantLayer
from titan_rl.models.ops import Ops

# (layer_index, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]: the row-mixing op
# each engine passes in (the trainer's dense causal attention, vLLM's paged one).
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
        if self.qweight is not None:
            return self.qweight.dense()
        if self.recipe is None:
            return self.weight
        from titan_rl.kernels.quant import fake_quantize

        return fake_quantize(self.weight, self.recipe, "weight")

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
    def prepare_for_engine(self) -> list[nn.Module]:
        """Prepare the weight for the GEMM once per load (the trainer prepares it per call:
        the same bits). A quantized weight that runs the quantized GEMM (`uses_quant_gemm`)
        is packed from the held payload + scales (no dense copy: the GEMM reads the payload);
        one that runs the dense form is dequantized here, once per load, into the GEMM's
        prepared layout (the same dense values the trainer's fake-quantized master gives).
        Returns the modules whose weights this covered."""
        if self.recipe is not None and uses_quant_gemm(self.recipe, *self._dtype_device()):
            self.gemm_weight = PackedQuant.of([self])
            self.packed_rows = (self.gemm_weight, 0, self.gemm_weight.n)
        else:
            self.gemm_weight = gemm_weight(self.operand_weight().detach())
        return [self]

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

    def _dtype_device(self) -> tuple[torch.dtype, torch.device]:
        """The dtype the GEMM computes in and the device, from what this module holds."""
        if self.qweight is not None:
            return self.qweight.dtype, self.qweight.payload.device
        return self.weight.dtype, self.weight.device

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


def fused_gemm_weight(mods: list[Linear]):
    """One prepared weight for modules that read the same input (q/k/v, gate/up:
    Ops.same_input), or None where they do not fuse (TP pieces). Quantized modules fuse
    their weights each quantized on its own: packed payloads for the quantized GEMM, else
    the dequantized weights."""
    if not mods[0].ops.fuse_same_input or mods[0].ops.tp_leaves:
        return None
    if mods[0].recipe is not None and uses_quant_gemm(mods[0].recipe, *mods[0]._dtype_device()):
        pq, start = PackedQuant.of(mods), 0
        for m in mods:
            m.packed_rows = (pq, start, start + m.out_rows)
            start += m.out_rows
        return pq
    return gemm_weight(torch.cat([m.operand_weight() for m in mods]).detach())


def prepare_for_engine(model: nn.Module) -> None:
    """Each module's engine preparation, once per weight load, outermost first: a module
    that prepares its children's weights itself (Attention's packed q/k/v) covers them.
    TP pieces (tp_leaves > 0) slice their weights per call: nothing is prepared. The LM
    head is not prepared here: the engine keeps its own fp32 copy."""
    if model.ops.tp_leaves:
        return
    done = {id(model.lm_head)}
    for m in model.modules():
        if m is not model and id(m) not in done and hasattr(m, "prepare_for_engine"):
            done.update(id(c) for c in m.prepare_for_engine())
