// The dpbf16 arithmetic on CPUs without AVX512-BF16: the same bits as vdpbf16ps from AVX2 FMAs.
//
// bf16_logits.cpp and quant_gemm.cpp define their outputs as AVX512-BF16's vdpbf16ps computes
// them: per output, one fp32 accumulator from +0, over k-pairs in order, adding the odd
// product and then the even one. Measured against the instruction on an AVX512-BF16 EPYC
// (tests/test_kernels.py pins it with subnormal-range operands), each add is one correctly
// rounded fused operation (the product is exact in fp32 and is not rounded or flushed on its
// own), subnormal inputs read as zero and a subnormal result is flushed to a zero of its sign.
// That is an FMA under MXCSR's DAZ and FTZ, which AVX2 CPUs have: so this form is not an
// approximation of the instruction's bits, it is the same sequence of roundings. A model
// trained on one CPU kind and resumed or served on the other keeps its bits.
//
// The weights come in the instruction's packed layout ([k-pairs][32 columns][2] bf16), whose
// 32-bit lane per column holds (even, odd): the odd element is already an fp32 in the top half
// and the even one becomes one by a 16-bit shift, so no shuffles are needed to widen.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <new>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TITAN_RL_DPBF16_AVX2 1

namespace titan_rl {
namespace {

// (FlushSubnormals, common.h: DAZ and FTZ for the scope. Scales applied after the dot products
// are ordinary fp32 arithmetic: leave the scope first.)

constexpr int DP2_MR = 5;  // rows per micro-tile: 10 accumulators + 2 weight registers + 1 broadcast
// (6 rows measured slower: GCC spilled accumulators; 4 rows 1.13x oneDNN's fp32 GEMM, 5 rows 1.06x)

// A chunk's rows as the tiles read them: tile by tile (DP2_MR rows from the chunk's first, the
// last tile the rest), per k-pair each row's odd element then its even one, as fp32 (exact).
// Made once per chunk and shared by every column block; broadcast from memory at fixed offsets
// of one pointer, the inputs cost the FMA pipes nothing and the tile no registers. Rows [i0, i1)
// of the chunk's `rows` (a: the chunk's first row, k-pairs as uint32).
inline void dp2_split(const uint32_t* a, int64_t rows, int64_t kp, float* xs, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t m0 = i - i % DP2_MR, R = rows - m0 < DP2_MR ? rows - m0 : DP2_MR, r = i - m0;
    float* t = xs + m0 * 2 * kp + 2 * r;
    for (int64_t p = 0; p < kp; ++p) {
      const uint32_t u = a[i * kp + p];
      t[p * 2 * R] = bits_to_f(u & 0xFFFF0000u);
      t[p * 2 * R + 1] = bits_to_f(u << 16);
    }
  }
}

// t[r][0..15] = the dot products of the tile's R rows (x: dp2_split's block of the tile) with
// columns c0 .. c0 + 15 of a packed block wb ([kp][32][2] bf16). Per k-pair all odd products,
// then all even ones: each output still adds its odd product before its even one. Call under
// FlushSubnormals.
// Not inlined: its registers must not depend on the caller (inlined into quant_gemm.cpp's
// epilogue, GCC spilled one accumulator, whose chain through the stack then set the pace: 1.7x).
template <int R>
__attribute__((noinline)) void dp2_tile(const float* x, const uint16_t* wb, int64_t kp, int64_t c0, float (*t)[16]) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  // (the unroll pragmas let GCC keep the accumulator array in registers: without them it
  // stored every accumulator to the stack on every k-pair)
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < kp; ++p, x += 2 * R) {
    const uint16_t* w = wb + p * 64 + 2 * c0;
    // the weights are loaded again for the even products (an L1 hit): holding them across the
    // odd ones would take two of the 16 registers the accumulators need
    __m256 w0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), high));
    __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)), high));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + 2 * r);
      acc[r][0] = _mm256_fmadd_ps(b, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, w1, acc[r][1]);
    }
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), 16));
    w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)), 16));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + 2 * r + 1);
      acc[r][0] = _mm256_fmadd_ps(b, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(t[r], acc[r][0]);
    _mm256_storeu_ps(t[r] + 8, acc[r][1]);
  }
}

// The rows [m, me) of a chunk (xs: dp2_split's, m a multiple of DP2_MR from the chunk's
// first row) against one packed block: emit(m, rows, c0, cols, t) receives each tile's
// 16-column halves with the subnormal flags restored (for the scales that follow).
template <class Emit>
inline void dp2_rows(const float* xs, int64_t m, int64_t me, int64_t kp, const uint16_t* wb, int64_t ncols,
                     const Emit& emit) {
  alignas(32) float t[DP2_MR][16];
  for (; m < me; m += DP2_MR) {
    const int64_t rows = me - m < DP2_MR ? me - m : DP2_MR;
    const float* x = xs + m * 2 * kp;
    for (int64_t c0 = 0; c0 < ncols; c0 += 16) {
      {
        FlushSubnormals flush;
        switch (rows) {
          case 5: dp2_tile<5>(x, wb, kp, c0, t); break;
          case 4: dp2_tile<4>(x, wb, kp, c0, t); break;
          case 3: dp2_tile<3>(x, wb, kp, c0, t); break;
          case 2: dp2_tile<2>(x, wb, kp, c0, t); break;
          default: dp2_tile<1>(x, wb, kp, c0, t); break;
        }
      }
      emit(m, rows, c0, ncols - c0 < 16 ? ncols - c0 : 16, t);
    }
  }
}

// The calling thread's buffer for a chunk's split rows (n floats), kept between calls.
inline float* dp2_rows_buffer(int64_t n) {
  struct Buf {
    float* p = nullptr;
    size_t bytes = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf b;
  const size_t need = static_cast<size_t>((n + 15) / 16) * 64;
  if (need > b.bytes) {
    std::free(b.p);
    b.p = static_cast<float*>(std::aligned_alloc(64, need));
    if (b.p == nullptr) throw std::bad_alloc();
    b.bytes = need;
  }
  return b.p;
}

}  // namespace
}  // namespace titan_rl
#endif
