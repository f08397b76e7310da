// fp32 linear for 1-4 rows with oneDNN's fp32 bits: the engine's decode at small batches.
//
// oneDNN's fp32 GEMM (brgemm) computes each output as FMA chains over k in order from +0,
// K cut in chunks whose sums are added in order (kernels/matmul/torch_impl.py reads the
// chunks off its outputs and checks this kernel against it for each K before using it).
// Padded to oneDNN's 8 rows, a single row costs 8 rows' products; here the weight streams
// once, and a tile holds enough independent chains (R rows x G column blocks) to keep the
// FMA pipes busy.
//
// Why the bits are oneDNN's: an output is one fp32 lane of one accumulator, fed one FMA per
// k (the product of its row's x[k], broadcast, and its column's w[k]) from +0 over each chunk
// in order; chunk sums are added to the total in order (the first is the total). SIMD lanes
// are independent, so the lane, the tile, the row count and the thread do not change an
// output's sequence of roundings; zero-padded columns feed only their own lanes.
//
// Weight layout (packed once per weight load): [ceil(N/16) blocks][K][16 columns], zeros
// past N.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace titan_rl {
namespace {

constexpr int64_t NB = 16;  // columns per packed block: one 16-lane accumulator

// "avx512" (the vector form the engine uses) or "generic" (the same bits lane by lane, not
// faster than the padded GEMM: the engine keeps padding there)
std::string form() {
#if defined(__AVX512F__)
  return "avx512";
#else
  return "generic";
#endif
}

at::Tensor pack(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat, "few_rows_f32_pack: a 2D float32 weight");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), nb = (N + NB - 1) / NB;
  at::Tensor p = at::zeros({nb, K, NB}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = p.data_ptr<float>();
  // k-major: the block's rows read side by side, the packed block written in order
  at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = std::min(NB, N - b * NB);
      const float* rows = src + b * NB * K;
      float* out = dst + b * K * NB;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < cols; ++c) out[k * NB + c] = rows[c * K + k];
    }
  });
  return p;
}

#if defined(__AVX512F__)
// k in [k0, k1) for R rows x G blocks (blocks bstride floats apart): out[r][16 g + l] = the
// chains (add: + the chains, one fp32 add). ncols < 16 G only when G = 1 (a last block).
template <int R, int G>
inline void tile(const float* const* x, const float* wb, int64_t bstride, int64_t k0, int64_t k1, float* const* out,
                 int64_t ncols, bool add) {
  __m512 acc[R][G];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m512 w[G];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) w[g] = _mm512_loadu_ps(wb + g * bstride + k * NB);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r][k]);
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(a, w[g], acc[r][g]);
    }
  }
  const __mmask16 m = ncols >= NB * G ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const __mmask16 mg = G == 1 ? m : 0xFFFF;
      __m512 v = acc[r][g];
      if (add) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mg, out[r] + NB * g), v);
      _mm512_mask_storeu_ps(out[r] + NB * g, mg, v);
    }
}
#else
// The same sequence of roundings, lane by lane (AVX2 and scalar builds).
template <int R, int G>
inline void tile(const float* const* x, const float* wb, int64_t bstride, int64_t k0, int64_t k1, float* const* out,
                 int64_t ncols, bool add) {
  float acc[R][G][NB] = {};
  for (int64_t k = k0; k < k1; ++k)
    for (int r = 0; r < R; ++r) {
      const float a = x[r][k];
      for (int g = 0; g < G; ++g) {
        const float* w = wb + g * bstride + k * NB;
        for (int l = 0; l < NB; ++l) acc[r][g][l] = __builtin_fmaf(a, w[l], acc[r][g][l]);
      }
    }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int l = 0; l < NB && g * NB + l < ncols; ++l) {
        float* o = out[r] + NB * g + l;
        *o = add ? *o + acc[r][g][l] : acc[r][g][l];
      }
}
#endif

// rows [0, R) against blocks [b0, b1): G blocks a tile while whole groups remain, then one at
// a time; K in chunks of kc (each from +0, added to the total in order)
template <int R, int G>
void rows(const float* x, int64_t K, int64_t kc, const float* wp, float* o, int64_t N, int64_t b0, int64_t b1) {
  const float* xr[R];
  float* orow[R];
  for (int r = 0; r < R; ++r) xr[r] = x + r * K;
  int64_t b = b0;
  for (; b + G <= b1 && (b + G) * NB <= N; b += G) {
    for (int r = 0; r < R; ++r) orow[r] = o + r * N + b * NB;
    for (int64_t k0 = 0; k0 < K; k0 += kc)
      tile<R, G>(xr, wp + b * K * NB, K * NB, k0, std::min(K, k0 + kc), orow, NB * G, k0 > 0);
  }
  for (; b < b1; ++b) {
    for (int r = 0; r < R; ++r) orow[r] = o + r * N + b * NB;
    for (int64_t k0 = 0; k0 < K; k0 += kc)
      tile<R, 1>(xr, wp + b * K * NB, K * NB, k0, std::min(K, k0 + kc), orow, std::min(NB, N - b * NB), k0 > 0);
  }
}

// x [M, K] fp32 (1 <= M <= 4), packed from `pack` (N given), k_chunk (0: one chain) -> [M, N] fp32
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, int64_t k_chunk) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "few_rows_f32: a 2D float32 input");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(M >= 1 && M <= 4, "few_rows_f32: 1-4 rows, got ", M);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == NB && packed.size(0) * NB >= N,
              "few_rows_f32: the weight must come from few_rows_f32_pack with K = ", K);
  TORCH_CHECK(k_chunk >= 0, "few_rows_f32: k_chunk must be >= 0");
  const at::Tensor x = x_in.contiguous();
  at::Tensor o = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const int64_t nb = (N + NB - 1) / NB, kc = k_chunk > 0 ? k_chunk : std::max<int64_t>(K, 1);
  // grain: whole groups of 8 blocks per thread (a group's outputs are the same either way)
  at::parallel_for(0, (nb + 7) / 8, 1, [=](int64_t g0, int64_t g1) {
    const int64_t b0 = g0 * 8, b1 = std::min(nb, g1 * 8);
    switch (M) {
      case 1: rows<1, 8>(xp, K, kc, wp, op, N, b0, b1); break;
      case 2: rows<2, 4>(xp, K, kc, wp, op, N, b0, b1); break;
      case 3: rows<3, 4>(xp, K, kc, wp, op, N, b0, b1); break;
      default: rows<4, 4>(xp, K, kc, wp, op, N, b0, b1); break;
    }
  });
  return o;
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("few_rows_f32_form() -> str", &titan_rl::form);
  m.def("few_rows_f32_pack(Tensor weight) -> Tensor", &titan_rl::pack);
  m.def("few_rows_f32(Tensor x, Tensor packed, int n, int k_chunk=0) -> Tensor", &titan_rl::linear);
}
