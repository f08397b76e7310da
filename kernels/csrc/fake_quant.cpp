// Fake quantization (quantize, then dequantize to the input's dtype) in one pass per block,
// exactly torchao's compositions (kernels/quant/torch_impl.py).
//
// fp8 (fp8_rowwise: a block is a row; fp8_block: 128 x 128 tiles of a weight, 1 x 128 of an
// activation row):
//   amax  = |x|.amax(block)                in x's dtype (exact: a max)
//   amax  = clamp(amax, min = AMAX_EPS)    the floor, as a value of x's dtype
//   scale = fp32(amax / 448)               the division in x's dtype (bf16: fp32, rounded)
//   q     = e4m3(clamp(fp32(x) / scale, -448, 448))
//   out   = x.dtype(fp32(q) * scale)
// Each conversion is c10's own (the function torch's .to() calls), each operation one
// IEEE operation on fp32 values, so the result is bit-for-bit torchao's.
//
// mxfp8: at mxfp8_rows below.
//
// nvfp4 (weights: one global scale g over the tensor; nvfp4_w4a4 activations: one per row):
//   g     = max(fp32(amax) / 2688, 2^-120)            2688 = 448 * 6
//   per block of 16: e = e4m3(clamp(fp32(amax_b) / 6 / g, 2^-6, 448))
//   q     = e2m1(clamp(fp32(x) * ((1 / g) / e), -6, 6))   (torchao multiplies by the reciprocal)
//   out   = x.dtype(q * (g * e))
//
// Why: torchao's forms are 8-20 tensor ops per call; at decode shapes (a few rows) the
// calls, not the arithmetic, cost ~100 us per linear, more than the GEMM, and the
// trainer fake-quantizes every weight on every forward. One fused pass per block here;
// blocks are independent (the weight's global amax is one exact max first), so the bits do
// not depend on the batch or the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "common.h"
#include "quant_common.h"

namespace titan_rl {
namespace {

// One fp8 block (rows of `cols` values, `stride` apart): the scale of the block's amax,
// then every value alone.
template <typename T>
void fp8_block(const T* x, T* out, int64_t rows, int64_t cols, int64_t stride, float eps) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t r = 0; r < rows; ++r) {
    const float a = abs_max(x + r * stride, cols);
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  const float s = fp8_scale<T>(nan ? NAN : amax, eps);
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * stride;
    T* yr = out + r * stride;
    for (int64_t j = 0; j < cols; ++j) {
      float v = to_f(xr[j]) / s;
      v = v < -FP8_MAX ? -FP8_MAX : (v > FP8_MAX ? FP8_MAX : v);  // clamp; NaN passes
      yr[j] = from_f<T>(round_e4m3(v) * s);
    }
  }
}

// [N, K] in blocks of br x bc, each alone (tiles row-major), split over threads by block.
template <typename T>
void fp8_blocks(const T* x, T* out, int64_t N, int64_t K, int64_t br, int64_t bc, float eps) {
  const int64_t tc = K / bc;
  at::parallel_for(0, (N / br) * tc, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t off = (t / tc) * br * K + (t % tc) * bc;
      fp8_block(x + off, out + off, br, bc, K, eps);
    }
  });
}

// clamp(ceil(torch.log2(d)), -127, 127) for a finite d >= 0 (log2(0) = -inf clamps to -127).
// torch's fp32 log2 rounds to the nearest fp32 before the ceil, so just above a power of two
// the ceil can stay below the exact one (2^10 (1 + 2^-23) -> 10, not 11). There the fp32
// rounding of a double log2 gives torch's exponent (compared with torch.log2 under ATen's
// avx512, avx2 and default capabilities on every fp32 within 2^14 ulps above each power of
// two, subnormals and 4M random values, 2026-12-05; tests/test_quant.py puts block amaxes
// there and compares the kernel with torchao).
inline float ceil_log2_as_torch(float d) {
  const uint32_t b = f_to_bits(d), frac = b & 0x7FFFFFu;
  const int biased = static_cast<int>(b >> 23);
  if (biased > 0 && (frac == 0 || frac >= (1u << 11))) {
    // a power of two: its exponent; a fraction >= 2^-12: log2 lies > 3e-4 above the exponent,
    // far beyond an fp32 rounding of it (ulp(127) = 2^-16), so the ceil is exponent + 1
    return static_cast<float>(biased - 127 + (frac != 0));
  }
  float l = std::ceil(static_cast<float>(std::log2(static_cast<double>(d))));  // near a power; subnormals; 0
  return l < -127.0f ? -127.0f : (l > 127.0f ? 127.0f : l);
}

// mxfp8 (RCEIL), per block of 32 of a row, as torchao's to_mx + to_dtype:
//   descale = fp32(amax) / 448
//   e       = NaN -> 255, inf -> 254, else clamp(ceil(log2(descale)), -127, 127) + 127
//   q       = e4m3(clamp(fp32(x) * r, -448, 448)),  r = 2^(127 - e) (e = 0: 1; e = 254: 2^-127)
//   out     = x.dtype(q * 2^(e - 127))             (e = 255: NaN)
template <typename T>
void mxfp8_rows(const T* x, T* out, int64_t N, int64_t K) {
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = r * K; b < (r + 1) * K; b += MX_BLOCK) {
        const float descale = abs_max(x + b, MX_BLOCK) / FP8_MAX;
        int e;
        if (descale != descale) {
          e = 255;
        } else if (std::isinf(descale)) {
          e = 254;
        } else {
          e = static_cast<int>(ceil_log2_as_torch(descale)) + 127;
        }
        const float rcp = e == 255 ? descale : (e == 254 ? std::ldexp(1.0f, -127) : (e == 0 ? 1.0f : std::ldexp(1.0f, 127 - e)));
        const float s = e == 255 ? NAN : static_cast<float>(static_cast<T>(std::ldexp(1.0f, e - 127)));
        for (int64_t j = b; j < b + MX_BLOCK; ++j) {
          float v = to_f(x[j]) * rcp;
          v = v < -FP8_MAX ? -FP8_MAX : (v > FP8_MAX ? FP8_MAX : v);
          out[j] = from_f<T>(round_e4m3(v) * s);
        }
      }
    }
  });
}

template <typename T>
void nvfp4_rows(const T* x, T* out, int64_t N, int64_t K, bool per_row, float g_min) {
  float g_all = 0.0f;
  if (!per_row) {
    g_all = abs_max(x, N * K) / NVFP4_GLOBAL_DIV;
    g_all = g_all < g_min ? g_min : g_all;
  }
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      T* yr = out + r * K;
      float g = g_all;
      if (per_row) {
        g = abs_max(xr, K) / NVFP4_GLOBAL_DIV;
        g = g < g_min ? g_min : g;
      }
      const float inv_g = 1.0f / g;
      for (int64_t b = 0; b < K; b += NVFP4_BLOCK) {
        float sb = abs_max(xr + b, NVFP4_BLOCK) / F4_MAX / g;
        sb = sb < E4M3_TINY ? E4M3_TINY : (sb > FP8_MAX ? FP8_MAX : sb);  // NaN passes
        const float e = round_e4m3(sb);
        const float recip = inv_g / e, hp = g * e;
        for (int64_t j = b; j < b + NVFP4_BLOCK; ++j) {
          float v = to_f(xr[j]) * recip;
          v = v < -F4_MAX ? -F4_MAX : (v > F4_MAX ? F4_MAX : v);
          yr[j] = from_f<T>(round_e2m1(v) * hp);
        }
      }
    }
  });
}

at::Tensor nvfp4_fake_quant(const at::Tensor& x_in, bool per_row, double g_min) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % NVFP4_BLOCK == 0, "nvfp4_fake_quant: [rows, K], K a multiple of 16");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t N = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    nvfp4_rows(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), N, K, per_row, static_cast<float>(g_min));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "nvfp4_fake_quant: bfloat16 or float32");
    nvfp4_rows(x.data_ptr<float>(), out.data_ptr<float>(), N, K, per_row, static_cast<float>(g_min));
  }
  return out;
}

at::Tensor fp8_fake_quant(const at::Tensor& x_in, int64_t block_rows, int64_t block_cols, double eps) {
  TORCH_CHECK(x_in.dim() == 2 && block_rows > 0 && block_cols > 0 && x_in.size(0) % block_rows == 0 &&
                  x_in.size(1) % block_cols == 0,
              "fp8_fake_quant: [rows, K] in whole blocks of block_rows x block_cols");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t N = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    fp8_blocks(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), N, K, block_rows, block_cols,
               static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "fp8_fake_quant: bfloat16 or float32");
    fp8_blocks(x.data_ptr<float>(), out.data_ptr<float>(), N, K, block_rows, block_cols, static_cast<float>(eps));
  }
  return out;
}

at::Tensor mxfp8_fake_quant(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % MX_BLOCK == 0, "mxfp8_fake_quant: [rows, K], K a multiple of 32");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t N = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    mxfp8_rows(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), N, K);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "mxfp8_fake_quant: bfloat16 or float32");
    mxfp8_rows(x.data_ptr<float>(), out.data_ptr<float>(), N, K);
  }
  return out;
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("fp8_fake_quant(Tensor x, int block_rows, int block_cols, float eps) -> Tensor", &titan_rl::fp8_fake_quant);
  m.def("mxfp8_fake_quant(Tensor x) -> Tensor", &titan_rl::mxfp8_fake_quant);
  m.def("nvfp4_fake_quant(Tensor x, bool per_row, float g_min) -> Tensor", &titan_rl::nvfp4_fake_quant);
}
