// Rounding and scale helpers shared by the fake quantization (fake_quant.cpp) and the
// quantized GEMM (quant_gemm.cpp): both must compute a recipe's payload and scales with the
// very same operations, so that the trainer's fake-quantized values, the payload the engine
// holds and the GEMM's operands are one function of the input.
#pragma once

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

// The fp8 scale of a block whose amax (a value of T, NaN propagated) is given:
// clamp(min=eps) in x's dtype (the floor is eps as a T; NaN stays NaN), then amax / 448 in
// x's dtype, as torchao's _choose_scale_float8.
template <typename T>
inline float fp8_scale(float amax, float eps) {
  const float lb = static_cast<float>(static_cast<T>(eps));
  amax = amax < lb ? lb : amax;
  return static_cast<float>(static_cast<T>(amax / FP8_MAX));
}

template <typename T>
inline float row_scale(const T* x, int64_t K, float eps) {
  return fp8_scale<T>(abs_max(x, K), eps);  // abs_max: NaN propagates, as torch's amax
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
constexpr int64_t NVFP4_BLOCK = 16, MX_BLOCK = 32;

}  // namespace
}  // namespace titan_rl
