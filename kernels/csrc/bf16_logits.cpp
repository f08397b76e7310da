// LM head from bf16 operands to fp32 logits with the CPU's bf16 dot-product instruction
// (AVX512-BF16 vdpbf16ps): logits[m, n] = sum over k of h[m, k] * w[n, k], each product
// exact in fp32 (8-bit by 8-bit significands), accumulated in fp32. It reads the bf16
// weight (half the bytes of an fp32 copy) and runs at bf16 GEMM speed where an fp32 head
// on upcast operands runs at fp32 speed.
//
// Why the bits are batch-invariant: an output is one fp32 lane of one accumulator, fed
// by vdpbf16ps over k-pairs 0, 1, ..., KP-1 in that order, starting from +0. SIMD lanes
// are independent, so neither the lane an output sits in, nor how many rows share the
// call, nor the tile it falls in, nor the thread that runs it changes its instruction
// sequence. Tails (rows of M, columns of N, an odd K) use the same instructions on
// zero-padded operands, so they too compute every output the same way.
//
// The weight is packed once ([N/32 blocks][K/2 pairs][32 columns][2], zero-padded), the
// layout the instruction wants: a pair (h[m, 2p], h[m, 2p+1]) broadcast against 16
// columns' pairs. The engine packs per weight load, the trainer per call.
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TITAN_RL_DPBF16 1
#else
#include "dpbf16_avx2.h"  // the same bits from AVX2 FMAs (its header says why they are the same)
#endif

namespace titan_rl {
namespace {

constexpr int64_t NB = 32;  // columns per packed block (two 16-lane accumulators)
constexpr int64_t MR = 8;   // rows per micro-tile (16 accumulators)
constexpr int64_t MC = 192; // rows kept hot in cache while the weight streams by
// Weight pairs fetched ahead of the one in use (4 KiB of the block): with 8 rows the loop is
// slow per byte and the hardware prefetcher alone left the stream and the arithmetic unoverlapped
// (Qwen3.5-0.8B's head, 248320 x 1024, 1 thread, Intel Xeon with AMX: 78 -> 50 ms at 8 rows,
// 50 -> 38 at 4, 36 -> 33 at 1). Bits unchanged: a prefetch moves no data into any result.
constexpr int64_t PF = 32;

bool available() {
#if defined(TITAN_RL_DPBF16) || defined(TITAN_RL_DPBF16_AVX2)
  return true;
#else
  return false;
#endif
}

// Which instructions compute the form here (the bits are the same either way).
std::string implementation() {
#if defined(TITAN_RL_DPBF16)
  return "avx512bf16";
#elif defined(TITAN_RL_DPBF16_AVX2)
  return "avx2-fma";
#else
  return "none";
#endif
}

// w [N, K] bf16 -> packed [ceil(N/32), ceil(K/2), 32, 2] bf16, zeros past N and K.
at::Tensor pack(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kBFloat16, "bf16_logits_pack: a 2D bfloat16 weight");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), nb = (N + NB - 1) / NB, kp = (K + 1) / 2;
  at::Tensor p = at::zeros({nb, kp, NB, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(p.data_ptr());
  // pair-major: the block's NB rows are read side by side (each row's cache line serves 16
  // pairs) and the packed block written in order (column-major writes ran 3x the reorder's time)
  at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = std::min(NB, N - b * NB);
      const uint16_t* rows = src + b * NB * K;
      uint16_t* out = dst + b * kp * NB * 2;
      for (int64_t q = 0; q < K / 2; ++q)
        for (int64_t c = 0; c < cols; ++c) {
          uint32_t v;
          std::memcpy(&v, rows + c * K + 2 * q, sizeof v);
          std::memcpy(out + (q * NB + c) * 2, &v, sizeof v);
        }
      if (K % 2)  // the last pair: (w[K-1], 0)
        for (int64_t c = 0; c < cols; ++c) out[((kp - 1) * NB + c) * 2] = rows[c * K + K - 1];
    }
  });
  return p;
}

#ifdef TITAN_RL_DPBF16
// the k-pairs [p0, p1) of rows r < R of a micro-tile, each output's chain from +0:
// out[r, 0:32] = that chain (add: out[r, 0:32] + that chain, one fp32 add)
template <int R>
inline void tile(const uint32_t* const* h, const uint16_t* wb, int64_t p0, int64_t p1, float* const* out,
                 int64_t ncols, bool add = false) {
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(wb + (p + PF) * NB * 2), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + (p + PF) * NB * 2 + 32), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + p * NB * 2);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + p * NB * 2 + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(h[r][p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
    }
  }
  const __mmask16 m0 = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (add) {
      acc[r][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, out[r]), acc[r][0]);
      acc[r][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, out[r] + 16), acc[r][1]);
    }
    _mm512_mask_storeu_ps(out[r], m0, acc[r][0]);
    _mm512_mask_storeu_ps(out[r] + 16, m1, acc[r][1]);
  }
}

// G column blocks at once for a few rows (decode: 1-4 rows): R x 2G accumulators are enough
// independent chains to keep the dot-product pipes busy where one block's 2R were not (at
// one row, 2 chains waited on the instruction's latency). Each output's instruction
// sequence is tile()'s, so its bits are too.
template <int R, int G>
inline void tile_wide(const uint32_t* const* h, const uint16_t* wb, int64_t bstride, int64_t p0, int64_t p1,
                      float* const* out, bool add) {
  __m512 acc[R][2 * G];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * G; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh w[2 * G];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(wb + g * bstride + (p + PF) * NB * 2), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wb + g * bstride + (p + PF) * NB * 2 + 32), _MM_HINT_T0);
      w[2 * g] = (__m512bh)_mm512_loadu_si512(wb + g * bstride + p * NB * 2);
      w[2 * g + 1] = (__m512bh)_mm512_loadu_si512(wb + g * bstride + p * NB * 2 + 32);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(h[r][p]));
#pragma GCC unroll 16
      for (int j = 0; j < 2 * G; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * G; ++j)
      _mm512_storeu_ps(out[r] + 16 * j, add ? _mm512_add_ps(_mm512_loadu_ps(out[r] + 16 * j), acc[r][j]) : acc[r][j]);
}

// rows [0, R) (R = M <= 4) against blocks [b0, b1): G blocks a tile while whole groups remain
// (their outputs written in place), the rest one block at a time through tile(). K in chunks
// of kcp pairs: each chunk's chain from +0, added to the chunks before in order (kcp = kp:
// one chain, the LM head's form; smaller: oneDNN's, see kernels/matmul/torch_impl.py).
template <int R, int G>
void few_rows(const uint32_t* h, int64_t kp, int64_t kcp, const uint16_t* wp, float* o, int64_t N, int64_t b0,
              int64_t b1) {
  const uint32_t* hr[R];
  float* orow[R];
  for (int r = 0; r < R; ++r) hr[r] = h + r * kp;
  int64_t b = b0;
  for (; b + G <= b1 && (b + G) * NB <= N; b += G) {
    for (int r = 0; r < R; ++r) orow[r] = o + r * N + b * NB;
    for (int64_t p0 = 0; p0 < kp; p0 += kcp)
      tile_wide<R, G>(hr, wp + b * kp * NB * 2, kp * NB * 2, p0, std::min(kp, p0 + kcp), orow, p0 > 0);
  }
  for (; b < b1; ++b) {
    for (int r = 0; r < R; ++r) orow[r] = o + r * N + b * NB;
    for (int64_t p0 = 0; p0 < kp; p0 += kcp)
      tile<R>(hr, wp + b * kp * NB * 2, p0, std::min(kp, p0 + kcp), orow, N - b * NB < NB ? N - b * NB : NB, p0 > 0);
  }
}

template <int R>
void rows_tile(const uint32_t* h, int64_t m0, int64_t kp, const uint16_t* wb, float* o, int64_t N, int64_t n0) {
  const uint32_t* hr[MR];
  float* orow[MR];
  for (int r = 0; r < R; ++r) {
    hr[r] = h + (m0 + r) * kp;
    orow[r] = o + (m0 + r) * N + n0;
  }
  tile<R>(hr, wb, 0, kp, orow, N - n0 < NB ? N - n0 : NB);
}
#endif

// h [M, K] bf16, packed from `pack` (N given) -> [M, N] fp32. k_chunk > 0 (even; 1-4 rows only,
// the AVX512-BF16 form): K in chunks of k_chunk, each chunk's chain from +0, summed in order.
at::Tensor logits(const at::Tensor& h_in, const at::Tensor& packed, int64_t N, int64_t k_chunk) {
  TORCH_CHECK(available(), "bf16_logits: this build has neither AVX512-BF16 nor AVX2 with FMA");
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kBFloat16, "bf16_logits: a 2D bfloat16 input");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == NB && packed.size(3) == 2 && packed.size(0) * NB >= N,
              "bf16_logits: the weight must come from bf16_logits_pack");
  const int64_t M = h_in.size(0), K = h_in.size(1), kp = packed.size(1);
  TORCH_CHECK(k_chunk == 0 || (k_chunk > 0 && k_chunk % 2 == 0 && M >= 1 && M <= 4 && implementation() == "avx512bf16"),
              "bf16_logits: k_chunk (", k_chunk, ") must be 0, or even with 1-4 rows on the AVX512-BF16 form");
  TORCH_CHECK((K + 1) / 2 == kp, "bf16_logits: input has K = ", K, ", the packed weight ", 2 * kp);
  // rows as k-pairs; an odd K gets one zero column (the packed weight has zeros there too)
  at::Tensor h = h_in.contiguous();
  if (K % 2) {
    at::Tensor hp = at::zeros({M, 2 * kp}, h.options());
    hp.narrow(1, 0, K).copy_(h);
    h = hp;
  }
  at::Tensor o = at::empty({M, N}, h.options().dtype(at::kFloat));
#ifdef TITAN_RL_DPBF16
  const uint32_t* hp = reinterpret_cast<const uint32_t*>(h.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* op = o.data_ptr<float>();
  const int64_t nb = (N + NB - 1) / NB;
  if (M >= 1 && M <= 4) {
    const int64_t kcp = k_chunk > 0 ? k_chunk / 2 : kp;
    // grain: whole groups of 4 blocks per thread (a group's outputs are the same either way)
    at::parallel_for(0, (nb + 3) / 4, 1, [=](int64_t g0, int64_t g1) {
      const int64_t b0 = g0 * 4, b1 = std::min(nb, g1 * 4);
      switch (M) {
        case 1: few_rows<1, 4>(hp, kp, kcp, wp, op, N, b0, b1); break;
        case 2: few_rows<2, 3>(hp, kp, kcp, wp, op, N, b0, b1); break;
        case 3: few_rows<3, 2>(hp, kp, kcp, wp, op, N, b0, b1); break;
        default: few_rows<4, 2>(hp, kp, kcp, wp, op, N, b0, b1); break;
      }
    });
    return o;
  }
  for (int64_t mc = 0; mc < M; mc += MC) {
    const int64_t me = mc + MC < M ? mc + MC : M;
    at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const uint16_t* wb = wp + b * kp * NB * 2;
        int64_t m = mc;
        for (; m + MR <= me; m += MR) rows_tile<MR>(hp, m, kp, wb, op, N, b * NB);
        switch (me - m) {
          case 7: rows_tile<7>(hp, m, kp, wb, op, N, b * NB); break;
          case 6: rows_tile<6>(hp, m, kp, wb, op, N, b * NB); break;
          case 5: rows_tile<5>(hp, m, kp, wb, op, N, b * NB); break;
          case 4: rows_tile<4>(hp, m, kp, wb, op, N, b * NB); break;
          case 3: rows_tile<3>(hp, m, kp, wb, op, N, b * NB); break;
          case 2: rows_tile<2>(hp, m, kp, wb, op, N, b * NB); break;
          case 1: rows_tile<1>(hp, m, kp, wb, op, N, b * NB); break;
          default: break;
        }
      }
    });
  }
#elif defined(TITAN_RL_DPBF16_AVX2)
  const uint32_t* hp = reinterpret_cast<const uint32_t*>(h.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* op = o.data_ptr<float>();
  const int64_t nb = (N + NB - 1) / NB;
  float* xs = dp2_rows_buffer(std::min(M, MC) * 2 * kp);
  for (int64_t mc = 0; mc < M; mc += MC) {
    const int64_t me = mc + MC < M ? mc + MC : M;
    at::parallel_for(0, me - mc, 16, [=](int64_t r0, int64_t r1) { dp2_split(hp + mc * kp, me - mc, kp, xs, r0, r1); });
    at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * NB;
        dp2_rows(xs - mc * 2 * kp, mc, me, kp, wp + b * kp * NB * 2, N - n0 < NB ? N - n0 : NB,
                 [=](int64_t m, int64_t rows, int64_t c0, int64_t cols, const float (*t)[16]) {
                   for (int64_t r = 0; r < rows; ++r)
                     std::memcpy(op + (m + r) * N + n0 + c0, t[r], cols * sizeof(float));
                 });
      }
    });
  }
#endif
  return o;
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("bf16_logits_available() -> bool", &titan_rl::available);
  m.def("dpbf16_implementation() -> str", &titan_rl::implementation);
  m.def("bf16_logits_pack(Tensor weight) -> Tensor", &titan_rl::pack);
  m.def("bf16_logits(Tensor hidden, Tensor packed, int n, int k_chunk=0) -> Tensor", &titan_rl::logits);
}
