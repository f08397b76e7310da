// a [M, N]^T @ b [M, K] -> [N, K] fp32, from the operands as they lie: the weight gradient of a
// linear (a = grad, b = x) and, with a = grad^T as a transposed view and b = W, its input
// gradient grad @ W. No transposed copies, no reorder. Each operand fp32 or bf16, not
// necessarily the same: the bf16 LM head's backward multiplies an fp32 grad by its bf16 weight.
//
// The bits: every output is one fp32 accumulator from +0 fed by one fused multiply-add per
// row m of a and b, in the order m = 0, 1, ..., M-1 (bf16 operands widened to fp32 first,
// exactly). The tiling (which lane, which tile, which chunk of rows, which thread) never
// changes that sequence: chunks of rows store the accumulator and reload it, which is exact.
// So the result depends only on the two operands' values, on every CPU this builds for
// (AVX-512, AVX2 and the scalar loop run the same FMAs), at any thread count and for any
// slice of N or K: a row of grad @ W has the same bits whatever rows share the call.
//
// Both operands bf16 (a bf16 model's linears): the same chain under DAZ and FTZ (subnormal
// inputs read as zero, subnormal results flushed to a zero of their sign), over M rounded up to
// even with a zero row. That is what AVX512-BF16's vdpbf16ps computes on a pair of rows when
// row m sits in the pair's odd (first-added) slot and row m + 1 in the even one (each add one
// fused operation under DAZ / FTZ: csrc/dpbf16_avx2.h), so on CPUs with the instruction one
// vdpbf16ps does two rows' FMAs: on the AMD EPYC (Zen 4), whose 512-bit FMAs issue one a cycle,
// that halves the bf16 backward's GEMM time; elsewhere the FMAs run under MXCSR's flags. The
// same bits either way: kernels/matmul/reference.py, weight_grad_bf16.
#include "common.h"
#include "fp32_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <vector>

namespace titan_rl {
namespace {

using namespace fp32v;
#if defined(__AVX512F__)
constexpr int NR = 12;  // output rows per micro-tile: 24 accumulators + 2 loads + 1 broadcast
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int NR = 6;  // 12 accumulators + 2 loads + 1 broadcast of AVX2's 16 registers
#else
constexpr int NR = 4;
#endif

constexpr int KR = 2 * VW;   // output columns per micro-tile
// Measured on the Intel Xeon (M 2048, N 512-16384, K 512-1536, fp32 and bf16): 128 rows by up to
// 1024 columns ran fastest of MC 64-2048 and KB 64-1024 (a chunk of packed x per micro-tile's
// columns stays in L1); 8 or 12 rows per tile did not matter.
constexpr int64_t MC = 128;  // rows of grad and x per chunk (packed, kept in cache)
constexpr int64_t KB = 1024;  // output columns per block of packed x
// Tiles whose grad is packed together: each group's part of grad is fetched into cache while the
// group before it computes (below). 8-32 ran alike; without the fetch, grouping gained nothing.
constexpr int64_t GT = 16;

// Each thread's packed group of grad tiles [GT][MC][NR], kept across chunks and calls.
thread_local std::vector<float> ap_buf;

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
// NR contiguous values of a tile's row into the packed tile, widened
inline void pack_row(const float* src, float* dst) { std::memcpy(dst, src, NR * sizeof(float)); }
inline void pack_row(const c10::BFloat16* src, float* dst) {
  uint16_t h[NR];
  std::memcpy(h, src, sizeof h);
  uint32_t w[NR];
  for (int j = 0; j < NR; ++j) w[j] = static_cast<uint32_t>(h[j]) << 16;
  std::memcpy(dst, w, sizeof w);
}

// acc[NR][2] over the chunk's rows: a = packed grad [rows][NR], b = packed x [rows][KR].
// first: start from +0, else from c (the previous chunks' sums).
// next: the next call's c, fetched into cache while this call computes. Where the output is larger
// than the caches (the LM head's weight gradient, 49152 x 576 fp32) each call's accumulators come
// from DRAM; fetched ahead, that call ran 15% faster (Intel Xeon, 1 thread; a hint, no bits move).
inline void micro(const float* a, const float* b, int64_t rows, float* c, int64_t ldc, bool first,
                  const float* next) {
  for (int i = 0; i < NR; ++i) {
    __builtin_prefetch(next + i * ldc, 1, 3);
    __builtin_prefetch(next + i * ldc + KR - 1, 1, 3);
  }
  vec acc[NR][2];
  for (int i = 0; i < NR; ++i) {
    acc[i][0] = first ? vzero() : vload(c + i * ldc);
    acc[i][1] = first ? vzero() : vload(c + i * ldc + VW);
  }
  for (int64_t m = 0; m < rows; ++m) {
    const vec b0 = vload(b + m * KR), b1 = vload(b + m * KR + VW);
    for (int i = 0; i < NR; ++i) {
      const vec x = vbcast(a + m * NR + i);
      acc[i][0] = vfma(x, b0, acc[i][0]);
      acc[i][1] = vfma(x, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    vstore(c + i * ldc, acc[i][0]);
    vstore(c + i * ldc + VW, acc[i][1]);
  }
}

// g: a [M, N] with row stride ldg and column stride sg1 (1: row-major; a transposed view of a
// row-major [N, M] has ldg 1). C [ceil(N / NR) * NR, ldc]: the output in whole tiles (ldc = K
// rounded up to KR), rows and columns past N and K computed from zero padding and not read.
template <typename TA, typename TB>
void weight_grad_impl(const TA* g, int64_t ldg, int64_t sg1, const TB* x, int64_t ldx, int64_t M, int64_t N,
                      int64_t K, float* C, int64_t ldc) {
  // bf16 x bf16: under DAZ / FTZ, the last chunk's rows rounded up to even with a zero row (the
  // dpbf16 form's definition, which this path computes on CPUs without the instruction)
  constexpr bool flush = std::is_same<TA, c10::BFloat16>::value && std::is_same<TB, c10::BFloat16>::value;
  const int64_t kb_pad = ((std::min(K, KB) + KR - 1) / KR) * KR;
  const int64_t n_tiles = (N + NR - 1) / NR;
  std::vector<float> bp(static_cast<size_t>(MC * kb_pad));
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t kn = std::min(KB, K - k0), ksub = (kn + KR - 1) / KR;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t mn = std::min(MC, M - m0);
      const int64_t mr = flush && mn % 2 ? mn + 1 : mn;  // rows the chain runs over (MC is even)
      float* B = bp.data();
      // x[m0:m0+mn, k0:k0+kn] -> [ksub][mn][KR] fp32, zeros past kn
      const int64_t kfull = kn / KR;  // whole micro-tiles of columns; the last may be partial
      at::parallel_for(0, mn, 32, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const TB* src = x + (m0 + r) * ldx + k0;
          for (int64_t s = 0; s < kfull; ++s) {
            float* dst = B + (s * mr + r) * KR;
            for (int j = 0; j < KR; ++j) dst[j] = widen(src[s * KR + j]);
          }
          if (kfull < ksub) {
            float* dst = B + (kfull * mr + r) * KR;
            const int64_t left = kn - kfull * KR;
            for (int j = 0; j < KR; ++j) dst[j] = j < left ? widen(src[kfull * KR + j]) : 0.0f;
          }
        }
      });
      if (mr > mn) {
        for (int64_t s = 0; s < ksub; ++s) std::fill(B + (s * mr + mn) * KR, B + (s * mr + mn + 1) * KR, 0.0f);
      }
      at::parallel_for(0, n_tiles, 4, [&](int64_t t0, int64_t t1) {
        FlushSubnormals flushed(flush);
        ap_buf.resize(static_cast<size_t>(MC * NR * GT));
        float* ap = ap_buf.data();
        for (int64_t tg = t0; tg < t1; tg += GT) {
          const int64_t tn = std::min<int64_t>(GT, t1 - tg);
          const int64_t n0 = tg * NR, nn = std::min<int64_t>(tn * NR, N - n0);
          // the group's columns of a -> [tile][row][NR], zeros past N
          if (nn < tn * NR || mr > mn) std::fill(ap, ap + tn * mr * NR, 0.0f);
          if (sg1 == 1) {
            for (int64_t r = 0; r < mn; ++r) {
              const TA* src = g + (m0 + r) * ldg + n0;
              int64_t i = 0;
              for (int64_t u = 0; u < tn && i + NR <= nn; ++u, i += NR) {
                pack_row(src + i, ap + (u * mr + r) * NR);
              }
              for (; i < nn; ++i) ap[((i / NR) * mr + r) * NR + i % NR] = widen(src[i]);
            }
          } else {
            for (int64_t i = 0; i < nn; ++i) {
              const TA* src = g + m0 * ldg + (n0 + i) * sg1;
              float* dst = ap + (i / NR) * mr * NR + i % NR;
              for (int64_t r = 0; r < mn; ++r) dst[r * NR] = widen(src[r * ldg]);
            }
          }
          // the next group's part of a, fetched into cache a few lines per micro-tile while this
          // group computes: its runs (rows, or columns of a transposed view) lie a stride apart,
          // which the hardware's prefetchers do not follow
          const TA* pf_base = nullptr;
          int64_t pf_rows = 0, pf_lines = 0, pf_stride = 0;
          {
            int64_t ntg = tg + GT, nm0 = m0;
            if (ntg >= t1) { ntg = t0; nm0 = m0 + MC; }
            if (nm0 < M && ntg * NR < N) {
              const int64_t nn1 = std::min<int64_t>(std::min<int64_t>(GT, t1 - ntg) * NR, N - ntg * NR);
              const int64_t mn1 = std::min(MC, M - nm0);
              pf_base = g + nm0 * ldg + ntg * NR * sg1;
              const bool rows = sg1 == 1;
              pf_rows = rows ? mn1 : nn1;
              pf_stride = rows ? ldg : sg1;
              pf_lines = ((rows ? nn1 : mn1) * (int64_t)sizeof(TA) + 63) / 64;
            }
          }
          const int64_t pf_total = pf_rows * pf_lines, calls = tn * ksub;
          const int64_t pf_each = calls > 0 ? (pf_total + calls - 1) / calls : 0;
          int64_t pf_r = 0, pf_l = 0;
          for (int64_t u = 0; u < tn; ++u) {
            const int64_t t = tg + u, tn0 = t * NR;
            for (int64_t s = 0; s < ksub; ++s) {
              for (int64_t q = 0; q < pf_each && pf_r < pf_rows; ++q) {
                const char* line = reinterpret_cast<const char*>(pf_base + pf_r * pf_stride) + pf_l * 64;
                __builtin_prefetch(line, 0, 1);
                if (++pf_l == pf_lines) { pf_l = 0; ++pf_r; }
              }
              float* c = C + tn0 * ldc + k0 + s * KR;
              float* next = s + 1 < ksub ? c + KR : (t + 1 < t1 ? C + (tn0 + NR) * ldc + k0 : c);
              micro(ap + u * mr * NR, B + s * mr * KR, mr, c, ldc, m0 == 0, next);
            }
          }
        }
      });
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TITAN_RL_WG_DPBF16 1
// The bf16 x bf16 form on vdpbf16ps: operands packed as row pairs, each 32-bit lane (row m's
// bf16 << 16) | row m + 1's, so the instruction adds row m's product (the odd slot) before row m
// + 1's: the flushed FMA chain above, two rows an instruction.
inline uint32_t pair(uint16_t first, uint16_t second) { return static_cast<uint32_t>(first) << 16 | second; }

// Each thread's packed group of grad tiles [GT][MC / 2][NR] pairs, kept across chunks and calls.
thread_local std::vector<uint32_t> ap2_buf;

// acc[NR][2] over the chunk's row pairs: a = packed grad pairs [pairs][NR], b = packed x pairs
// [pairs][KR]; first / next as in micro.
inline void micro_dp(const uint32_t* a, const uint32_t* b, int64_t pairs, float* c, int64_t ldc, bool first,
                     const float* next) {
  for (int i = 0; i < NR; ++i) {
    __builtin_prefetch(next + i * ldc, 1, 3);
    __builtin_prefetch(next + i * ldc + KR - 1, 1, 3);
  }
  __m512 acc[NR][2];
  for (int i = 0; i < NR; ++i) {
    acc[i][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);
    acc[i][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + 16);
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * KR), b1 = (__m512bh)_mm512_loadu_si512(b + p * KR + 16);
    for (int i = 0; i < NR; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[p * NR + i]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, b1);
    }
  }
  for (int i = 0; i < NR; ++i) {
    _mm512_storeu_ps(c + i * ldc, acc[i][0]);
    _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);
  }
}

// weight_grad_impl's loops for two bf16 operands (as raw uint16), on micro_dp
void weight_grad_dp(const uint16_t* g, int64_t ldg, int64_t sg1, const uint16_t* x, int64_t ldx, int64_t M, int64_t N,
                    int64_t K, float* C, int64_t ldc) {
  const int64_t kb_pad = ((std::min(K, KB) + KR - 1) / KR) * KR;
  const int64_t n_tiles = (N + NR - 1) / NR;
  std::vector<uint32_t> bp(static_cast<size_t>(MC / 2 * kb_pad));
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t kn = std::min(KB, K - k0), ksub = (kn + KR - 1) / KR;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t mn = std::min(MC, M - m0), np = (mn + 1) / 2;  // row pairs, the last maybe half zero
      uint32_t* B = bp.data();
      // x[m0:m0+mn, k0:k0+kn] -> [ksub][np][KR] pairs, zeros past kn and mn
      at::parallel_for(0, np, 16, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
          const uint16_t* r0 = x + (m0 + 2 * p) * ldx + k0;
          const uint16_t* r1 = 2 * p + 1 < mn ? r0 + ldx : nullptr;
          for (int64_t s = 0; s < ksub; ++s) {
            uint32_t* dst = B + (s * np + p) * KR;
            for (int j = 0; j < KR; ++j) {
              const int64_t k = s * KR + j;
              dst[j] = k < kn ? pair(r0[k], r1 ? r1[k] : 0) : 0u;
            }
          }
        }
      });
      at::parallel_for(0, n_tiles, 4, [&](int64_t t0, int64_t t1) {
        ap2_buf.resize(static_cast<size_t>(MC / 2 * NR * GT));
        uint32_t* ap = ap2_buf.data();
        for (int64_t tg = t0; tg < t1; tg += GT) {
          const int64_t tn = std::min<int64_t>(GT, t1 - tg);
          const int64_t n0 = tg * NR, nn = std::min<int64_t>(tn * NR, N - n0);
          // the group's columns of a -> [tile][pair][NR], zeros past N and mn
          if (nn < tn * NR) std::fill(ap, ap + tn * np * NR, 0u);
          if (sg1 == 1) {
            for (int64_t p = 0; p < np; ++p) {
              const uint16_t* r0 = g + (m0 + 2 * p) * ldg + n0;
              const uint16_t* r1 = 2 * p + 1 < mn ? r0 + ldg : nullptr;
              for (int64_t i = 0; i < nn; ++i) ap[((i / NR) * np + p) * NR + i % NR] = pair(r0[i], r1 ? r1[i] : 0);
            }
          } else {
            for (int64_t i = 0; i < nn; ++i) {
              const uint16_t* src = g + m0 * ldg + (n0 + i) * sg1;
              uint32_t* dst = ap + (i / NR) * np * NR + i % NR;
              for (int64_t p = 0; p < np; ++p) {
                dst[p * NR] = pair(src[2 * p * ldg], 2 * p + 1 < mn ? src[(2 * p + 1) * ldg] : 0);
              }
            }
          }
          for (int64_t u = 0; u < tn; ++u) {
            const int64_t t = tg + u, tn0 = t * NR;
            for (int64_t s = 0; s < ksub; ++s) {
              float* c = C + tn0 * ldc + k0 + s * KR;
              float* next = s + 1 < ksub ? c + KR : (t + 1 < t1 ? C + (tn0 + NR) * ldc + k0 : c);
              micro_dp(ap + u * np * NR, B + s * np * KR, np, c, ldc, m0 == 0, next);
            }
          }
        }
      });
    }
  }
}
#endif

}  // namespace

at::Tensor weight_grad(const at::Tensor& grad, const at::Tensor& x) {
  TORCH_CHECK(grad.dim() == 2 && x.dim() == 2 && grad.size(0) == x.size(0),
              "weight_grad: grad [M, N] and x [M, K]");
  auto fp32_or_bf16 = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
  };
  TORCH_CHECK(fp32_or_bf16(grad) && fp32_or_bf16(x), "weight_grad: fp32 or bf16 operands (each widened exactly)");
  const at::Tensor g = (grad.stride(1) == 1 || grad.stride(0) == 1) ? grad : grad.contiguous();
  const at::Tensor xx = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = g.size(0), N = g.size(1), K = xx.size(1);
  const int64_t rows = (N + NR - 1) / NR * NR, ldc = (K + KR - 1) / KR * KR;
  at::Tensor c = M == 0 ? at::zeros({rows, ldc}, g.options().dtype(at::kFloat))
                        : at::empty({rows, ldc}, g.options().dtype(at::kFloat));
  if (M > 0 && N > 0 && K > 0) {
    const bool af = g.scalar_type() == at::kFloat, bf = xx.scalar_type() == at::kFloat;
    using B16 = c10::BFloat16;
#define TITAN_WG(TA, TB)                                                                                      \
  weight_grad_impl(g.data_ptr<TA>(), g.stride(0), g.stride(1), xx.data_ptr<TB>(), xx.stride(0), M, N, K, \
                   c.data_ptr<float>(), ldc)
    if (af && bf) TITAN_WG(float, float);
    else if (af) TITAN_WG(float, B16);
    else if (bf) TITAN_WG(B16, float);
    else {
#if defined(TITAN_RL_WG_DPBF16)
      weight_grad_dp(reinterpret_cast<const uint16_t*>(g.data_ptr<B16>()), g.stride(0), g.stride(1),
                     reinterpret_cast<const uint16_t*>(xx.data_ptr<B16>()), xx.stride(0), M, N, K, c.data_ptr<float>(),
                     ldc);
#else
      TITAN_WG(B16, B16);
#endif
    }
#undef TITAN_WG
  }
  // [N, K] of the tiles: a view where K is whole tiles (the usual widths), else a copy
  at::Tensor out = c.narrow(0, 0, N).narrow(1, 0, K);
  return ldc == K ? out : out.contiguous();
}

}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("weight_grad(Tensor grad, Tensor x) -> Tensor", &titan_rl::weight_grad);
}
