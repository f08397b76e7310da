// Shared pieces of titan_rl's compiled CPU kernels.
//
// The exactness rule for everything compiled here: a value's bits depend only on the
// values it is computed from, never on where it sits in a buffer, how many rows share
// the call, or the thread count. So:
//   * only IEEE basic operations (+ - * / sqrt, explicit fma, comparisons, bit casts);
//     the build passes -ffp-contract=off, so the compiler cannot fuse a*b+c into an FMA
//     in one copy of a loop (the vector body) and not in another (the scalar tail); an
//     FMA is written out (__builtin_fmaf: one correctly rounded operation, vector or not);
//   * reductions run over explicit lanes (LANES independent partial sums) combined by a
//     fixed halving tree, so vectorising them changes nothing;
//   * transcendentals are our own polynomials (exp_f below), identical whether a lane
//     is computed in a SIMD register or alone.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace titan_rl {

constexpr int LANES = 16;

// MXCSR's DAZ and FTZ for the scope (subnormal inputs read as zero, subnormal results flushed to
// a zero of their sign): the flags under which FMAs compute what vdpbf16ps computes
// (dpbf16_avx2.h). MXCSR is per thread: set inside each parallel_for body. `on` false: a no-op.
struct FlushSubnormals {
  unsigned saved = 0;
  bool on;
  explicit FlushSubnormals(bool on_ = true) : on(on_) {
#if defined(__SSE__)
    if (on) {
      saved = _mm_getcsr();
      _mm_setcsr(saved | 0x8040u);
    }
#endif
  }
  ~FlushSubnormals() {
#if defined(__SSE__)
    if (on) _mm_setcsr(saved);
#endif
  }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;
};

inline float bits_to_f(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t f_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}


// exp(x) from a fixed range reduction and polynomial (Cephes expf coefficients),
// accurate to ~2 ulp on [-87, 88]; inputs are clamped to that range (NaN propagates:
// the clamps are comparisons, false for NaN).
inline float exp_f(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // n = round-to-nearest(x / ln 2) by the 1.5 * 2^23 trick (an IEEE add; vectorises)
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r;
  y = y + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  return y * bits_to_f(bits);
}

// Sum of the LANES partial sums by a fixed halving tree.
inline float lane_tree(float* a) {
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) a[l] = a[l] + a[l + w];
  return a[0];
}

// bf16 <-> fp32 as integer operations (vectorise; same results as c10::BFloat16:
// widening is exact, narrowing rounds to nearest even, NaN stays a quiet NaN).
inline float bf16_to_f(uint16_t h) { return bits_to_f(static_cast<uint32_t>(h) << 16); }

inline uint16_t f_to_bf16(float f) {
  const uint32_t b = f_to_bits(f);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
}

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return bf16_to_f(x.x); }

template <typename T>
inline T from_f(float x);
template <>
inline float from_f<float>(float x) { return x; }
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float x) { return c10::BFloat16(f_to_bf16(x), c10::BFloat16::from_bits()); }

}  // namespace titan_rl
