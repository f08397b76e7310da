// Fake quantization (quantize, then dequantize to the input's dtype) in one pass per row,
// exactly torchao's compositions (kernels/quant/torch_impl.py).
//
// fp8_rowwise:
//   amax  = |x|.amax(row)                  in x's dtype (exact: a max)
//   amax  = clamp(amax, min = AMAX_EPS)    the floor, as a value of x's dtype
//   scale = fp32(amax / 448)               the division in x's dtype (bf16: fp32, rounded)
//   q     = e4m3(clamp(fp32(x) / scale, -448, 448))
//   out   = x.dtype(fp32(q) * scale)
// Each conversion is c10's own (the function torch's .to() calls), each operation one
// IEEE operation on fp32 values, so the result is bit-for-bit torchao's.
//
// nvfp4 (weights: one global scale g over the tensor; nvfp4_w4a4 activations: one per row):
//   g     = max(fp32(amax) / 2688, 2^-120)            2688 = 448 * 6
//   per block of 16: e = e4m3(clamp(fp32(amax_b) / 6 / g, 2^-6, 448))
//   q     = e2m1(clamp(fp32(x) * ((1 / g) / e), -6, 6))   (torchao multiplies by the reciprocal)
//   out   = x.dtype(q * (g * e))
//
// Why: torchao's forms are 8-20 tensor ops per call; at decode shapes (a few rows) the
// calls, not the arithmetic, cost ~100 us per linear, more than the GEMM, and the
// trainer fake-quantizes every weight on every forward. One fused pass per row here;
// rows are independent (the weight's global amax is one exact max first), so the bits do
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

namespace titan_rl {
namespace {

constexpr float FP8_MAX = 448.0f;

// fp32 -> e4m3fn -> fp32 for |v| <= 448 (the caller clamps), round to nearest even, as
// c10::Float8_e4m3fn's conversion (checked against it for every fp32 value in
// [-448, 448]), but branch-free so the loop vectorises: normal e4m3 values keep 3
// mantissa bits, subnormal ones (|v| < 2^-6) are multiples of 2^-9. NaN stays NaN.
inline float round_e4m3(float v) {
  const uint32_t b = f_to_bits(v), sign = b & 0x80000000u, a = b & 0x7FFFFFFFu;
  const float av = bits_to_f(a);
  const uint32_t normal = (a + 0x7FFFFu + ((a >> 20) & 1u)) & 0xFFF00000u;
  constexpr float M = 12582912.0f;  // 1.5 * 2^23: (t + M) - M rounds t to an integer, ties to even
  const float sub = ((av * 512.0f + M) - M) * (1.0f / 512.0f);
  const uint32_t r = av < 0.015625f ? f_to_bits(sub) : normal;
  return av != av ? v : bits_to_f(r | sign);
}

// max_j |x_j| (NaN if any is NaN): LANES independent maxima, then their max. A max is
// exact and its order does not matter, so this equals torch's amax; the lanes let the
// loop vectorise (a running max over one variable does not).
template <typename T>
inline float abs_max(const T* x, int64_t n) {
  float m[LANES];
  bool nan[LANES];
  for (int l = 0; l < LANES; ++l) m[l] = 0.0f, nan[l] = false;
  const int64_t full = n - n % LANES;
  for (int64_t j0 = 0; j0 < full; j0 += LANES)
    for (int l = 0; l < LANES; ++l) {
      const float a = std::fabs(to_f(x[j0 + l]));
      nan[l] |= a != a;
      m[l] = a > m[l] ? a : m[l];
    }
  for (int64_t j = full; j < n; ++j) {
    const float a = std::fabs(to_f(x[j]));
    nan[0] |= a != a;
    m[0] = a > m[0] ? a : m[0];
  }
  float r = 0.0f;
  bool any_nan = false;
  for (int l = 0; l < LANES; ++l) r = m[l] > r ? m[l] : r, any_nan |= nan[l];
  return any_nan ? NAN : r;
}

template <typename T>
inline float row_scale(const T* x, int64_t K, float eps) {
  float amax = abs_max(x, K);  // NaN propagates, as torch's amax
  // clamp(min=eps) in x's dtype: the floor is eps as a T; NaN stays NaN
  const float lb = static_cast<float>(static_cast<T>(eps));
  amax = amax < lb ? lb : amax;
  return static_cast<float>(static_cast<T>(amax / FP8_MAX));
}

template <typename T>
void fake_quant_rows(const T* x, T* out, int64_t N, int64_t K, float eps) {
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      T* yr = out + r * K;
      const float s = row_scale(xr, K, eps);
      for (int64_t j = 0; j < K; ++j) {
        float v = to_f(xr[j]) / s;
        v = v < -FP8_MAX ? -FP8_MAX : (v > FP8_MAX ? FP8_MAX : v);  // clamp; NaN passes
        const float q = round_e4m3(v);
        yr[j] = from_f<T>(q * s);
      }
    }
  });
}

// |v| <= 6 (the caller clamps) -> the nearest e2m1 value {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to
// the even mantissa (torchao's f32_to_f4_unpacked), sign kept (-0 stays -0); NaN stays NaN.
inline float round_e2m1(float v) {
  const float a = std::fabs(v);
  // branch-free (selects vectorise; the data-dependent branches mispredicted): steps of
  // 0.5, 0.5, 0.5, 0.5, 1, 1, 2 at the midpoints, a tie going to the even neighbour
  const float r = (a > 0.25f ? 0.5f : 0.0f) + (a >= 0.75f ? 0.5f : 0.0f) + (a > 1.25f ? 0.5f : 0.0f) +
                  (a >= 1.75f ? 0.5f : 0.0f) + (a > 2.5f ? 1.0f : 0.0f) + (a >= 3.5f ? 1.0f : 0.0f) +
                  (a > 5.0f ? 2.0f : 0.0f);
  const float signed_r = bits_to_f(f_to_bits(r) | (f_to_bits(v) & 0x80000000u));
  return a != a ? v : signed_r;
}

constexpr float F4_MAX = 6.0f, NVFP4_GLOBAL_DIV = 448.0f * 6.0f, E4M3_TINY = 0.015625f;
constexpr int64_t NVFP4_BLOCK = 16;

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

at::Tensor fp8_rowwise_fake_quant(const at::Tensor& x_in, double eps) {
  TORCH_CHECK(x_in.dim() == 2, "fp8_rowwise_fake_quant: a 2D tensor [rows, K]");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t N = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    fake_quant_rows(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), N, K, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "fp8_rowwise_fake_quant: bfloat16 or float32");
    fake_quant_rows(x.data_ptr<float>(), out.data_ptr<float>(), N, K, static_cast<float>(eps));
  }
  return out;
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("fp8_rowwise_fake_quant(Tensor x, float eps) -> Tensor", &titan_rl::fp8_rowwise_fake_quant);
  m.def("nvfp4_fake_quant(Tensor x, bool per_row, float g_min) -> Tensor", &titan_rl::nvfp4_fake_quant);
}
