"""Plain definitions of the recipes: one block at a time, every step written out.

Slow and obviously right; the same arithmetic as torch_impl (each scale from the block's
amax in the input's dtype, as torchao computes it, then the steps below in fp32), so the
tests compare the two bit for bit. The FP4 rounding is written here from the format
(round to nearest, ties to the even code) rather than torchao's bit manipulation.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP4_MAX = 6.0
AMAX_EPS = 1e-12
E4M3_MIN_NORMAL = 2.0 ** -6
NVFP4_SCALE_MIN = 2.0 ** -120
# e2m1 magnitudes by code 0..7; the midpoints between neighbours with the code below
# each midpoint odd round up there (ties to the even code).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _blocks(rows: int, k: int, block: tuple[int, int]):
    for r in range(0, rows, block[0]):
        for c in range(0, k, block[1]):
            yield r, c


def fp8_quantize(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 payload and fp32 scales [rows / block[0], K / block[1]]: scale = amax / 448."""
    rows, k = x.shape
    payload = torch.empty(rows, k, dtype=FP8)
    scales = torch.empty(rows // block[0], k // block[1], dtype=torch.float32)
    for r, c in _blocks(rows, k, block):
        tile = x[r:r + block[0], c:c + block[1]]
        amax = torch.clamp(tile.abs().max(), min=AMAX_EPS)
        scale = (amax / FP8_MAX).to(torch.float32)
        scales[r // block[0], c // block[1]] = scale
        payload[r:r + block[0], c:c + block[1]] = (tile.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return payload, scales


def fp8_dequantize(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, k = payload.shape
    block = (rows // scales.shape[0], k // scales.shape[1])
    out = torch.empty(rows, k, dtype=dtype)
    for r, c in _blocks(rows, k, block):
        tile = payload[r:r + block[0], c:c + block[1]].to(torch.float32)
        out[r:r + block[0], c:c + block[1]] = (tile * scales[r // block[0], c // block[1]]).to(dtype)
    return out


def mxfp8_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 payload and E8M0 scales [rows, K / 32]. The exponent is RCEIL: the smallest power
    of two 2^e with amax / 2^e <= 448, e = ceil(log2(amax / 448)) in fp32, clamped to E8M0's
    -127..127. An all-zero block stores e = -127 (code 0) and scales by 1."""
    rows, k = x.shape
    payload = torch.empty(rows, k, dtype=FP8)
    codes = torch.empty(rows, k // block, dtype=torch.uint8)
    for r, c in _blocks(rows, k, (1, block)):
        vals = x[r, c:c + block]
        amax = vals.abs().max().to(torch.float32)
        e = torch.clamp(torch.ceil(torch.log2(amax / FP8_MAX)), -127, 127)
        code = (e + 127).to(torch.uint8)
        inv = torch.tensor(1.0) if code == 0 else torch.exp2(127 - code.to(torch.float32))
        codes[r, c // block] = code
        payload[r, c:c + block] = (vals.to(torch.float32) * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return payload, codes.view(torch.float8_e8m0fnu)


def mxfp8_dequantize(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, k = payload.shape
    block = k // scales.shape[1]
    out = torch.empty(rows, k, dtype=dtype)
    for r, c in _blocks(rows, k, (1, block)):
        e = scales[r, c // block].view(torch.uint8).to(torch.float32) - 127
        out[r, c:c + block] = payload[r, c:c + block].to(dtype) * torch.exp2(e).to(dtype)
    return out


def fp4_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] -> e2m1 codes (bit 3 = sign), nearest, ties to the even code."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8)
    for lower in range(7):
        mid = (FP4_VALUES[lower] + FP4_VALUES[lower + 1]) / 2
        up = mag >= mid if lower % 2 else mag > mid
        code += up.to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def fp4_decode(code: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    sign = 1.0 - 2.0 * (code >> 3).to(torch.float32)
    return table[(code & 7).long()] * sign


def nvfp4_quantize(x: torch.Tensor, per_row_global: bool, block: int = 16):
    """Packed e2m1 payload [rows, K / 2] (element 2j in the low nibble), e4m3 block scales
    [rows, K / 16] and the fp32 global scale g = amax / (448 * 6): over the tensor ([]) or
    over each row ([rows, 1]), floored at 2^-120. Each block: s = e4m3(clamp(amax_block /
    6 / g)), values x * ((1 / g) / s) rounded to e2m1."""
    rows, k = x.shape
    if per_row_global:
        g = torch.stack([x[r].abs().max() for r in range(rows)]).to(torch.float32)[:, None] / (FP8_MAX * FP4_MAX)
    else:
        g = x.abs().max().to(torch.float32) / (FP8_MAX * FP4_MAX)
    g = torch.clamp(g, min=NVFP4_SCALE_MIN)
    codes = torch.empty(rows, k, dtype=torch.uint8)
    block_scales = torch.empty(rows, k // block, dtype=FP8)
    for r, c in _blocks(rows, k, (1, block)):
        gr = g[r, 0] if per_row_global else g
        vals = x[r, c:c + block].to(torch.float32)
        s = torch.clamp(vals.abs().max() / FP4_MAX / gr, min=E4M3_MIN_NORMAL, max=FP8_MAX).to(FP8)
        block_scales[r, c // block] = s
        scaled = (vals * ((1.0 / gr) / s.to(torch.float32))).clamp(-FP4_MAX, FP4_MAX)
        codes[r, c:c + block] = fp4_encode(scaled)
    payload = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return payload, block_scales, g


def nvfp4_dequantize(payload: torch.Tensor, block_scales: torch.Tensor, g: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    rows, k = payload.shape[0], payload.shape[1] * 2
    block = k // block_scales.shape[1]
    codes = torch.empty(rows, k, dtype=torch.uint8)
    codes[:, 0::2], codes[:, 1::2] = payload & 15, payload >> 4
    out = torch.empty(rows, k, dtype=dtype)
    for r, c in _blocks(rows, k, (1, block)):
        gr = g[r, 0] if g.dim() == 2 else g
        scale = gr * block_scales[r, c // block].to(torch.float32)
        out[r, c:c + block] = (fp4_decode(codes[r, c:c + block]) * scale).to(dtype)
    return out


def quantize_reference(x: torch.Tensor, recipe: str, role: str):
    """(payload, scales) as torch_impl returns them, from the definitions above."""
    weight = role == "weight"
    if recipe == "fp8_rowwise":
        payload, s = fp8_quantize(x, (1, x.shape[1]))
        return payload, (s,)
    if recipe == "fp8_block":
        payload, s = fp8_quantize(x, (128, 128) if weight else (1, 128))
        return payload, (s,)
    if recipe == "mxfp8":
        payload, s = mxfp8_quantize(x)
        return payload, (s,)
    if recipe in ("nvfp4", "nvfp4_w4a4"):
        payload, s, g = nvfp4_quantize(x, per_row_global=not weight)
        return payload, (s, g)
    raise ValueError(f"no reference for recipe {recipe!r}")


def dequantize_reference(payload: torch.Tensor, scales, recipe: str, dtype: torch.dtype) -> torch.Tensor:
    if recipe in ("fp8_rowwise", "fp8_block"):
        return fp8_dequantize(payload, scales[0], dtype)
    if recipe == "mxfp8":
        return mxfp8_dequantize(payload, scales[0], dtype)
    if recipe in ("nvfp4", "nvfp4_w4a4"):
        return nvfp4_dequantize(payload, scales[0], scales[1], dtype)
    raise ValueError(f"no reference for recipe {recipe!r}")
