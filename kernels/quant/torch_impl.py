"""Quantize / dequantize per recipe on torchao 0.18's primitives (CPU, both engines).

Every scale is dynamic and computed from data that belongs to one row (activations) or
to the weight alone (weights), so a row's payload and scales never depend on the other
rows of a batch. Layouts are plain (row-major payload, scales [rows, K / block]); GEMM
kernels that want swizzled scales rearrange them themselves.

From torchao, unchanged:
  fp8_rowwise, fp8_block  _choose_scale_float8 + _quantize_affine_float8 /
                          _dequantize_affine_float8 (the Float8Tensor path of
                          Float8DynamicActivationFloat8WeightConfig, kernel "torch")
  mxfp8                   to_mx(..., RCEIL) / to_dtype (MXTensor's emulated path)
  nvfp4 block step        nvfp4_quantize with a global scale (NVFP4Tensor.to_nvfp4)

Hand-written here, and why:
  * the fp8 amax floor (AMAX_EPS): torchao's float8 primitives divide by amax / 448, so an
    all-zero row (or 128x128 tile) gives 0 / 0 = NaN; torchao's float8 training path
    floors amax at the same 1e-12 (torchao.float8.float8_utils.EPS).
  * the NVFP4 global scale: torchao computes it over the whole tensor (weights: kept) and
    has no per-row form for activations. nvfp4_w4a4's activations take one global scale
    per row (per_tensor_amax_to_scale of the row's amax), passed to nvfp4_quantize in the
    [rows, 1, 1] shape of its per-expert path, which broadcasts one scale per row. The
    scale g is floored at 2^-120, so that x * (1 / g) / (the smallest e4m3 block scale,
    2^-6) stays finite: an all-zero row (or weight) is zeros, not 0 * inf = NaN.
  * fake quantization of every recipe (`*_fake`): the same compositions fused into one
    pass per block in C++ (csrc/fake_quant.cpp), bit-for-bit torchao's (tests/test_quant.py
    pits them on odd shapes, zeros, tiny and huge rows, inf and NaN). torchao's forms are
    8-20 tensor ops, ~80 us per decode-sized call (more than the GEMM they feed) and 24 ms
    per nvfp4 fake-quantize of a 1024 x 1024 weight (the fused one: 2.7 ms; 1 thread).
  * NVFP4 dequantize: NVFP4Tensor.dequantize accepts only a per-tensor (or per-expert 3D)
    global scale; this applies torchao's arithmetic (global * e4m3 block scale, times the
    fp4 value, in fp32) to either shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
from torchao.quantization.quant_primitives import (
    _choose_scale_float8, _dequantize_affine_float8, _quantize_affine_float8,
)

from titan_rl.kernels.quant.recipes import Role, Scales

FP8 = torch.float8_e4m3fn
AMAX_EPS = 1e-12
FP8_BLOCK_WEIGHT = (128, 128)
FP8_BLOCK_ACTIVATION = (1, 128)
MX_BLOCK = 32
NVFP4_BLOCK = 16
NVFP4_SCALE_MIN = 2.0 ** -120

QuantizeFn = Callable[[torch.Tensor], tuple[torch.Tensor, Scales]]
DequantizeFn = Callable[[torch.Tensor, Scales, torch.dtype], torch.Tensor]


def check_blocks(x: torch.Tensor, recipe: str, role: Role, block: tuple[int, int]) -> None:
    """A ValueError naming the shape and the block when x does not tile into blocks."""
    if x.dim() != 2:
        raise ValueError(f"{recipe} quantizes 2D tensors [rows, K]; got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{recipe} quantizes bfloat16 or float32 tensors; got {x.dtype}")
    rows, k = x.shape
    if rows % block[0] or k % block[1]:
        raise ValueError(f"{recipe} quantizes {role}s in blocks of {block[0]}x{block[1]} (rows x K); shape "
                         f"{tuple(x.shape)} does not divide into them")


def _fp8(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, Scales]:
    x = x.contiguous()
    scale = _choose_scale_float8(x, block_size=list(block), float8_dtype=FP8, hp_value_lb=AMAX_EPS)
    return _quantize_affine_float8(x, scale, FP8), (scale,)


def fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, Scales]:
    """e4m3 payload; one fp32 scale per row, [rows, 1] (weights: per output channel)."""
    return _fp8(x, (1, x.shape[1]))


def fp8_block_weight(x: torch.Tensor) -> tuple[torch.Tensor, Scales]:
    """e4m3 payload; one fp32 scale per 128x128 tile, [rows / 128, K / 128]."""
    return _fp8(x, FP8_BLOCK_WEIGHT)


def fp8_block_activation(x: torch.Tensor) -> tuple[torch.Tensor, Scales]:
    """e4m3 payload; one fp32 scale per 1x128 block of a row, [rows, K / 128]."""
    return _fp8(x, FP8_BLOCK_ACTIVATION)


def _fp8_fake(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    from titan_rl.kernels.cpu_ext import ops

    if x.numel() == 0:  # no blocks (a row-wise block of an empty row would be 1 x 0)
        return x.clone()
    return ops().fp8_fake_quant(x, block[0], block[1], AMAX_EPS)


def fp8_rowwise_fake(x: torch.Tensor) -> torch.Tensor:
    """fp8_dequantize(*fp8_rowwise(x), x.dtype), fused (csrc/fake_quant.cpp; x on CPU, 2D,
    bf16 or fp32: kernels.quant.fake_quantize checks); NaN stays NaN."""
    return _fp8_fake(x, (1, x.shape[1]))


def fp8_block_weight_fake(x: torch.Tensor) -> torch.Tensor:
    """fp8_dequantize(*fp8_block_weight(x), x.dtype), fused (csrc/fake_quant.cpp)."""
    return _fp8_fake(x, FP8_BLOCK_WEIGHT)


def fp8_block_activation_fake(x: torch.Tensor) -> torch.Tensor:
    """fp8_dequantize(*fp8_block_activation(x), x.dtype), fused (csrc/fake_quant.cpp)."""
    return _fp8_fake(x, FP8_BLOCK_ACTIVATION)


def fp8_dequantize(payload: torch.Tensor, scales: Scales, dtype: torch.dtype) -> torch.Tensor:
    return _dequantize_affine_float8(payload, scales[0], dtype)


def mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, Scales]:
    """e4m3 payload; one E8M0 scale per 32 elements of a row, [rows, K / 32] (RCEIL)."""
    scale, payload = to_mx(x.contiguous(), FP8, MX_BLOCK, ScaleCalculationMode.RCEIL)
    return payload, (scale,)


def mxfp8_dequantize(payload: torch.Tensor, scales: Scales, dtype: torch.dtype) -> torch.Tensor:
    return to_dtype(payload, scales[0], FP8, MX_BLOCK, dtype)


def mxfp8_fake(x: torch.Tensor) -> torch.Tensor:
    """mxfp8_dequantize(*mxfp8(x), x.dtype), fused (csrc/fake_quant.cpp)."""
    from titan_rl.kernels.cpu_ext import ops

    return ops().mxfp8_fake_quant(x)


def _nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, Scales]:
    global_scale = global_scale.clamp(min=NVFP4_SCALE_MIN)
    per_row = global_scale.dim() == 2
    block, payload = nvfp4_quantize(x.contiguous(), NVFP4_BLOCK, global_scale[..., None] if per_row else global_scale)
    return payload, (block.view(x.shape[0], -1), global_scale)


def nvfp4_weight(x: torch.Tensor) -> tuple[torch.Tensor, Scales]:
    """fp4 e2m1 payload packed two per byte [rows, K / 2]; one e4m3 scale per 16 elements of
    a row [rows, K / 16]; one fp32 global scale over the weight, []."""
    return _nvfp4(x, per_tensor_amax_to_scale(x.abs().amax()))


def nvfp4_activation(x: torch.Tensor) -> tuple[torch.Tensor, Scales]:
    """As nvfp4_weight, with one fp32 global scale per row, [rows, 1]."""
    return _nvfp4(x, per_tensor_amax_to_scale(x.abs().amax(dim=1, keepdim=True)))


def _nvfp4_fake(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    from titan_rl.kernels.cpu_ext import ops

    return ops().nvfp4_fake_quant(x, per_row, NVFP4_SCALE_MIN)


def nvfp4_weight_fake(x: torch.Tensor) -> torch.Tensor:
    """nvfp4_dequantize(*nvfp4_weight(x), x.dtype), fused (csrc/fake_quant.cpp)."""
    return _nvfp4_fake(x, per_row=False)


def nvfp4_activation_fake(x: torch.Tensor) -> torch.Tensor:
    """nvfp4_dequantize(*nvfp4_activation(x), x.dtype), fused (csrc/fake_quant.cpp)."""
    return _nvfp4_fake(x, per_row=True)


def nvfp4_dequantize(payload: torch.Tensor, scales: Scales, dtype: torch.dtype) -> torch.Tensor:
    block, global_scale = scales
    rows, k = payload.shape[0], payload.shape[1] * 2
    values = f4_unpacked_to_f32(unpack_uint4(payload.contiguous())).view(rows, k // NVFP4_BLOCK, NVFP4_BLOCK)
    hp_scales = global_scale * block.to(torch.float32)
    return (values * hp_scales[..., None]).view(rows, k).to(dtype)


@dataclass(frozen=True)
class RecipeImpl:
    """One recipe's functions and the block each role must tile into (rows x K)."""

    quantize_weight: QuantizeFn
    weight_block: tuple[int, int]
    quantize_activation: QuantizeFn | None  # None: activations stay in their dtype (weight-only)
    activation_block: tuple[int, int]
    dequantize: DequantizeFn
    # dequantize(quantize(x)) in one step, same bits, where a fused form exists (per role)
    fake_quantize_weight: Callable[[torch.Tensor], torch.Tensor] | None = None
    fake_quantize_activation: Callable[[torch.Tensor], torch.Tensor] | None = None

    def check(self, x: torch.Tensor, recipe: str, role: Role) -> None:
        """check_blocks for the role's block."""
        check_blocks(x, recipe, role, self.weight_block if role == "weight" else self.activation_block)


RECIPES: dict[str, RecipeImpl] = {
    "fp8_rowwise": RecipeImpl(fp8_rowwise, (1, 1), fp8_rowwise, (1, 1), fp8_dequantize, fp8_rowwise_fake,
                              fp8_rowwise_fake),
    "fp8_block": RecipeImpl(fp8_block_weight, FP8_BLOCK_WEIGHT, fp8_block_activation, FP8_BLOCK_ACTIVATION,
                            fp8_dequantize, fp8_block_weight_fake, fp8_block_activation_fake),
    "mxfp8": RecipeImpl(mxfp8, (1, MX_BLOCK), mxfp8, (1, MX_BLOCK), mxfp8_dequantize, mxfp8_fake, mxfp8_fake),
    "nvfp4": RecipeImpl(nvfp4_weight, (1, NVFP4_BLOCK), None, (1, NVFP4_BLOCK), nvfp4_dequantize, nvfp4_weight_fake),
    "nvfp4_w4a4": RecipeImpl(nvfp4_weight, (1, NVFP4_BLOCK), nvfp4_activation, (1, NVFP4_BLOCK), nvfp4_dequantize,
                             nvfp4_weight_fake, nvfp4_activation_fake),
}
