"""The quantized GEMM: a covered linear as one compiled call on the weight's payload
(csrc/quant_gemm.cpp; docs/quantization.md, "The quantized GEMM").

Where it runs (`quant_gemm_form()`, a platform choice in the self-check report and the execution
contract): "dpbf16" on every x86 CPU this project runs on, for bf16 models and the recipes in
FORMATS (fp8_rowwise, nvfp4, nvfp4_w4a4): with AVX512-BF16 and AVX512-VBMI by vdpbf16ps,
expanding the payload per tile; with AVX2 + FMA by FMAs under DAZ/FTZ on blocks expanded once
(csrc/dpbf16_avx2.h says why those are the same bits; tests/test_masked_cpu.py compares the two
bit for bit). `quant_gemm_implementation()` names the instructions; it does not change a bit.
Everywhere else ("dense": fp32 models, CUDA, the other recipes, a CPU without AVX2) a quantized
linear is the invariant `linear` on fake-quantized operands. `uses_quant_gemm` is the one
decision both engines take, from the recipe and the input's dtype and device, so they always
run the same form.

The dpbf16 form's arithmetic (the recipe's definition on a CPU): the GEMM multiplies the
quantized values themselves, exact in bf16 (an e4m3 value; an e2m1 value times its e4m3 block
scale), accumulates their exact products in fp32 over k-pairs in order (vdpbf16ps: per pair
the odd product, then the even one), and applies the remaining scales to the fp32 sum:
  fp8_rowwise  y = bf16((D * s_x) * s_w)      s_x per input row, s_w per weight row
  nvfp4        y = bf16(D * g_w)              x unquantized, g_w the weight's global scale
  nvfp4_w4a4   y = bf16((D * g_x) * g_w)      g_x the input row's global scale
(torch._scaled_mm's shape of computation: the scales after an fp32 dot product.) The dense
form instead multiplies the fake-quantized operands (each product scale * value rounded to
the model's dtype first). `quant_linear_reference` below is the dpbf16 form in torch, op for
op; the tests compare the kernel with it bit for bit.

Engine: `PackedQuant.of(mods)` once per weight load, from the held payload + scales (no dense
copy). Trainer: `quant_linear(x, [weights], recipe)` quantizes its weights per call with the
compiled quantizers (the payload `kernels.quant.quantize` gives, bit for bit) and packs them the
same way; its backward is the straight-through one of the dense form (the gradients of `linear`
at the fake-quantized operands), unchanged.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch

from titan_rl.kernels.cpu_ext import ops as _ops
from titan_rl.kernels.matmul.reference import dpbf16_dot

# recipe -> the kernel's format code (csrc/quant_gemm.cpp)
FORMATS = {"fp8_rowwise": 0, "nvfp4": 1, "nvfp4_w4a4": 2}
AMAX_EPS = 1e-12           # kernels/quant/torch_impl.py's (the fp8 amax floor)
NVFP4_SCALE_MIN = 2.0 ** -120  # ... and the nvfp4 global-scale floor


@lru_cache(maxsize=1)
def quant_gemm_form() -> str:
    """The platform's form (the module docstring): "dpbf16" where the compiled kernel has the
    instructions, else "dense". Asked on first use, not at import: importing the model code
    must not build the extension (a CUDA machine never needs it)."""
    try:
        return "dpbf16" if _ops().quant_gemm_available() else "dense"
    except (RuntimeError, OSError):
        return "dense"


@lru_cache(maxsize=1)
def quant_gemm_implementation() -> str:
    """Which instructions run the dpbf16 form here: "avx512bf16" (vdpbf16ps) or "avx2-fma"
    (the same bits from FMAs under DAZ/FTZ: csrc/dpbf16_avx2.h); "none" where it is absent."""
    try:
        return str(_ops().dpbf16_implementation()) if quant_gemm_form() == "dpbf16" else "none"
    except (RuntimeError, OSError):
        return "none"


def uses_quant_gemm(recipe: str | None, dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where a linear of `recipe` with `dtype` operands on `device` runs the quantized
    GEMM (both engines ask this; the answer depends on nothing else)."""
    if recipe not in FORMATS or dtype != torch.bfloat16:
        return False
    from titan_rl.kernels import dispatch

    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    # CPU tensors on the CPU kernels (not under dispatch.use_backend("triton"), which runs the GPU
    # code path on CPU: there quantized linears stay the dense form, as on CUDA)
    return kind == "cpu" and dispatch.backend_for(kind) == "torch" and quant_gemm_form() == "dpbf16"


def _param(recipe: str) -> float:
    return NVFP4_SCALE_MIN if recipe == "nvfp4_w4a4" else AMAX_EPS


def quantize_weight(w: torch.Tensor, recipe: str):
    """(payload, scales) of a weight by the compiled quantizers: exactly
    kernels.quant.quantize(w, recipe, "weight") (tests/test_quant_gemm.py), in one pass."""
    w = w.detach()
    if recipe == "fp8_rowwise":
        codes, scale = _ops().fp8_rowwise_quant(w, AMAX_EPS)
        return codes.view(torch.float8_e4m3fn), (scale,)
    payload, block, g = _ops().nvfp4_quant(w, False, NVFP4_SCALE_MIN)
    return payload, (block.view(torch.float8_e4m3fn), g)


class PackedQuant:
    """Quantized weights [N, K] (one, or several that read the same input, concatenated
    along N) in the kernel's layout: payload packed per 32 columns, block scales (nvfp4), and
    one fp32 scale per output column (fp8: the row scale; nvfp4: the part's global scale),
    padded to whole blocks. Opaque: only `quant_linear` reads it."""

    __slots__ = ("recipe", "n", "k", "packed", "block_scales", "col_scale", "expanded")

    def __init__(self, recipe: str, n: int, k: int, packed: torch.Tensor, block_scales: torch.Tensor | None,
                 col_scale: torch.Tensor):
        if recipe not in FORMATS:
            raise ValueError(f"the quantized GEMM runs {sorted(FORMATS)}; not {recipe!r}")
        self.recipe, self.n, self.k = recipe, n, k
        self.packed, self.block_scales, self.col_scale = packed, block_scales, col_scale
        # the AVX2 form multiplies bf16 blocks expanded once from `packed` (csrc/quant_gemm.cpp,
        # quant_expand); None where the AVX512 form expands per tile
        self.expanded = _ops().quant_expand(packed, block_scales, FORMATS[recipe])

    def read_fields(self) -> tuple[str, ...]:
        """The fields the forward reads on this CPU: the AVX2 form its expanded bf16 blocks
        (the block scales folded in) and the column scales; the AVX512 form the packed payload,
        the block scales (nvfp4) and the column scales."""
        if self.expanded is not None:
            return ("expanded", "col_scale")
        return ("packed", *(("block_scales",) if self.block_scales is not None else ()), "col_scale")

    @classmethod
    def from_parts(cls, recipe: str, parts: Sequence[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]) -> "PackedQuant":
        """From (payload, scales) per weight, as kernels.quant.quantize gives them (the engine's
        held QuantizedWeights)."""
        payloads = [p for p, _ in parts]
        n = sum(p.shape[0] for p in payloads)
        if recipe == "fp8_rowwise":
            packed = _ops().fp8_pack(torch.cat([p.view(torch.uint8) for p in payloads]))
            blocks, col, k = None, torch.cat([s[0].reshape(-1) for _, s in parts]).float(), payloads[0].shape[1]
        else:
            blocks = torch.cat([s[0].view(torch.uint8) for _, s in parts])
            packed, blocks = _ops().nvfp4_pack(torch.cat(payloads), blocks)
            col = torch.cat([s[1].reshape(-1).float().expand(p.shape[0]) for p, s in parts])
            k = payloads[0].shape[1] * 2
        # padded to whole blocks of 32 columns: the kernel's tiles read 32 at a time
        return cls(recipe, n, k, packed, blocks, torch.nn.functional.pad(col, (0, -n % 32)).contiguous())

    @classmethod
    def of(cls, mods: Sequence) -> "PackedQuant":
        """The engine's preparation of Linear modules (one recipe): from each one's held
        QuantizedWeight, or from its weight where it holds none."""
        return cls.of_weights(mods[0].recipe, [m.qweight if m.qweight is not None else m.weight for m in mods])

    @classmethod
    def of_weights(cls, recipe: str, weights: Sequence) -> "PackedQuant":
        """From weights of one recipe, each a QuantizedWeight (its payload + scales as held or
        shipped) or a dense tensor (quantized here by the compiled quantizers)."""
        from titan_rl.kernels.quant import QuantizedWeight

        return cls.from_parts(recipe, [(w.payload, w.scales) if isinstance(w, QuantizedWeight)
                                       else quantize_weight(w, recipe) for w in weights])

    @classmethod
    def prepare(cls, ws: Sequence[torch.Tensor], recipe: str) -> tuple["PackedQuant", torch.Tensor]:
        """The trainer's per-call preparation of bf16 weights, in one compiled pass: the packed
        payloads `from_parts` makes of their quantize() output, and the dense fake-quantized
        concatenation (the backward's weight), bit for bit (tests/test_quant_gemm.py)."""
        ws = [w.detach() for w in ws]
        n, k = sum(w.shape[0] for w in ws), ws[0].shape[1]
        if quant_gemm_implementation() != "avx512bf16":  # the one-pass preparation is AVX512 code
            from titan_rl.kernels.quant import _fake_quantize_values

            dense = torch.cat([_fake_quantize_values(w, recipe, "weight") for w in ws])
            return cls.from_parts(recipe, [quantize_weight(w, recipe) for w in ws]), dense
        if recipe == "fp8_rowwise":
            packed, col, dense = _ops().fp8_prepare(ws, AMAX_EPS)
            return cls(recipe, n, k, packed, None, col), dense
        packed, blocks, col, dense = _ops().nvfp4_prepare(ws, NVFP4_SCALE_MIN)
        return cls(recipe, n, k, packed, blocks, col), dense

    def unpack(self, start: int, stop: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(payload, scales) of rows [start, stop) (one part: one weight of a fused [q; k; v]) as
        kernels.quant.quantize gives them, read back from the packed bytes the GEMM reads: what
        the engine's weight checksum dequantizes (titan_rl.quant_weights.engine_weights)."""
        nb, kp = self.packed.shape[0], self.packed.shape[1]
        if self.recipe == "fp8_rowwise":  # [b][p][column][k parity] -> [b, column][p, parity]
            codes = self.packed.view(nb, kp, 32, 2).permute(0, 2, 1, 3).reshape(nb * 32, 2 * kp)
            payload = codes[start:stop, :self.k].contiguous().view(torch.float8_e4m3fn)
            return payload, (self.col_scale[start:stop, None].clone(),)
        # [b][p][c16][parity] bytes, low nibble column c16, high nibble column 16 + c16
        b = self.packed.view(nb, kp, 16, 2)
        nib = torch.stack([b & 15, b >> 4], 2)  # [b, p, nibble, c16, parity]
        codes = nib.permute(0, 2, 3, 1, 4).reshape(nb * 32, 2 * kp)[start:stop]
        payload = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        blocks = self.block_scales.permute(0, 2, 1).reshape(nb * 32, -1)[start:stop].contiguous()
        return payload, (blocks.view(torch.float8_e4m3fn), self.col_scale[start].clone())

    @property
    def data(self) -> torch.Tensor:  # the dispatcher reads a prepared weight's device from .data
        return self.packed


def quant_operands(mods: Sequence):
    """What the quantized GEMM multiplies for Linear modules that read one input (one recipe):
    the engine's held payloads and scales, packed now (a PackedQuant: where it holds them but
    has not prepared them), or the trainer's weights, which `quant_linear` quantizes per call
    (gradients flow to them)."""
    if all(m.qweight is not None for m in mods):
        return PackedQuant.of(mods)
    return [m.weight for m in mods]


def _run(x2: torch.Tensor, pq: PackedQuant) -> torch.Tensor:
    if x2.shape[-1] != pq.k:
        raise ValueError(f"quant_linear: input has K = {x2.shape[-1]}, the weight {pq.k}")
    return _ops().quant_linear(x2, pq.packed, pq.block_scales, pq.col_scale, pq.n, FORMATS[pq.recipe],
                               _param(pq.recipe), pq.expanded)


class _QuantLinear(torch.autograd.Function):
    """Forward: the quantized GEMM on the weights quantized now. Backward: the gradients of
    the invariant `linear` at the fake-quantized operands (straight through the quantizers),
    as the dense form's; each weight's gradient its rows of the concatenation's."""

    @staticmethod
    def forward(ctx, x2, recipe, *ws):
        pq, w_fq = PackedQuant.prepare(ws, recipe)
        ctx.save_for_backward(x2, w_fq)
        ctx.recipe, ctx.rows, ctx.dtypes = recipe, [w.shape[0] for w in ws], [w.dtype for w in ws]
        return _run(x2, pq)

    @staticmethod
    def backward(ctx, grad):
        from titan_rl.kernels.matmul.torch_impl import grad_input, grad_weight
        from titan_rl.kernels.quant import _fake_quantize_values, quantizes_activations

        x2, w_fq = ctx.saved_tensors
        grad = grad.to(x2.dtype)
        gx = gws = None
        if ctx.needs_input_grad[0]:
            gx = grad_input(grad, w_fq)
        if any(ctx.needs_input_grad[2:]):
            x_fq = _fake_quantize_values(x2, ctx.recipe, "activation") if quantizes_activations(ctx.recipe) else x2
            gws = [g.to(d) for g, d in zip(grad_weight(grad, x_fq).split(ctx.rows), ctx.dtypes)]
        return (gx, None, *(gws if gws is not None else [None] * len(ctx.rows)))


def quant_linear(x: torch.Tensor, weight, recipe: str | None = None) -> torch.Tensor:
    """y = x @ W^T in the recipe's dpbf16 form (bf16 x on CPU), each row independent of the
    others and of the thread count. `weight`: a PackedQuant (engine), or the weights [N_i, K]
    to quantize now and concatenate along N (trainer; gradients flow to them)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(weight, PackedQuant):
        return _run(x2, weight).reshape(*lead, weight.n)
    ws = list(weight)
    n = sum(w.shape[0] for w in ws)
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws)):
        y = _QuantLinear.apply(x2, recipe, *ws)
    else:
        y = _run(x2, PackedQuant.prepare(ws, recipe)[0])
    return y.reshape(*lead, n)


# -- the reference: the dpbf16 form in torch, op for op ----------------------------------------

def _values(payload: torch.Tensor, scales, recipe: str) -> torch.Tensor:
    """The bf16-exact values the kernel multiplies: e4m3 (fp8), e2m1 * block scale (nvfp4)."""
    if recipe == "fp8_rowwise":
        return payload.float()
    from titan_rl.kernels.quant.reference import fp4_decode

    codes = torch.stack([payload & 15, payload >> 4], -1).reshape(payload.shape[0], -1)
    return fp4_decode(codes) * scales[0].float().repeat_interleave(16, dim=1)


def quant_linear_reference(x: torch.Tensor, ws: Sequence[torch.Tensor], recipe: str) -> torch.Tensor:
    """The dpbf16 form from kernels.quant.quantize's payloads and scales, in torch (slow):
    what quant_linear computes, bit for bit."""
    from titan_rl.kernels.quant import quantize

    parts = [quantize(w, recipe, "weight") for w in ws]
    w_vals = torch.cat([_values(p, s, recipe) for p, s in parts])
    if recipe == "fp8_rowwise":
        col = torch.cat([s[0].reshape(-1) for _, s in parts])
    else:
        col = torch.cat([s[1].reshape(-1).expand(p.shape[0]) for p, s in parts])
    if recipe == "nvfp4":
        a, row = x.float(), None
    else:
        p, s = quantize(x, recipe, "activation")
        a = _values(p, s, recipe)
        row = s[0].reshape(-1) if recipe == "fp8_rowwise" else s[1].reshape(-1)
    d = dpbf16_dot(a, w_vals)
    if row is not None:
        d = d * row[:, None]
    return (d * col[None, :]).to(torch.bfloat16)
