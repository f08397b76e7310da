// fp32 GEMMs as FMA chains in a fixed order: oneDNN's fp32 bits without oneDNN, at any row count.
//
// oneDNN's fp32 GEMM (brgemm) computes each output as FMA chains over k in order from +0, K cut
// in chunks whose sums are added in order (kernels/matmul/torch_impl.py reads the chunks off its
// outputs and checks this kernel against it for each K before using it). This file computes
// exactly that, given the chunk:
//   * `chain_f32` (any row count) on a packed weight (`few_rows_f32_pack`): the trainer's fp32
//     forward, packed per call, 0.9-1.0x oneDNN's time at the trainer's shapes (its own blocking
//     below); the engine keeps oneDNN at 5+ rows, with the same bits;
//   * `few_rows_f32` (1-4 rows, the engine's decode): the weight streams once, where oneDNN pads to
//     8 rows and computes 8 rows' products to keep 1;
//   * `chain_f32_plain`: x [M, N] @ w [N, K] for w as it lies (the input gradient grad @ W of a
//     linear: no transposed weight), one chain over N per output (no chunks).
//
// Why the bits do not depend on the rows beside a row, the thread count or the CPU kind: an output
// is one fp32 lane of one accumulator, fed one FMA per k (its row's x[k], broadcast, times its
// column's w[k]) from +0 over each chunk in order; chunk sums are added to the total in order (the
// first is the total). SIMD lanes are independent and AVX-512, AVX2 and the scalar loop issue the
// same FMAs, so the lane, the tile, the row count, the thread and the vector width do not change an
// output's sequence of roundings; zero-padded columns feed only their own lanes.
//
// Packed weight layout: [ceil(N/16) blocks][K][16 columns], zeros past N.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "fp32_vec.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace titan_rl {
namespace {

constexpr int64_t NB = 16;  // columns per block

using namespace fp32v;
#if defined(__AVX512F__)
constexpr int TR = 6, TG = 4;  // main tile: 6 rows x 4 blocks = 24 accumulators (+4 loads, 1 broadcast)
// blocks per tile for fewer rows (the rows left over, decode's 1-4): at least 8 independent chains
constexpr int tail_g(int r) { return r == 1 ? 8 : 4; }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int TR = 6, TG = 1;  // 6 rows x 1 block (2 vectors) = 12 accumulators of AVX2's 16 registers
constexpr int tail_g(int r) { return r == 1 ? 4 : r == 2 ? 2 : 1; }
#else
constexpr int TR = 4, TG = 1;
constexpr int tail_g(int) { return 1; }
#endif
constexpr int VB = NB / VW;  // vectors per block

std::string form() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "generic";
#endif
}

// A packed weight as the chains read it: w(k, column c) = p[(c / 16) * bstride + k * ldw + c % 16].
struct WView {
  const float* p;
  int64_t ldw, bstride;
};

// What a tile does with out: store its chains, add them to out (a later oneDNN chunk: one fp32 add),
// or go on with the chains out holds (a later block of one chain: loaded and stored, exact).
enum Mode { STORE, ADD, CONTINUE };

// Rows [0, R) of x (row stride ldx) against blocks [b, b + G), k in [k0, k1). ncols < 16 G: only
// the first ncols columns of out are read and written (the last block).
template <int R, int G>
inline void tile(const float* x, int64_t ldx, WView w, int64_t b, int64_t k0, int64_t k1, float* out, int64_t ldo,
                 int64_t ncols, Mode mode) {
  const bool whole = ncols >= NB * G;
  vec acc[R][G * VB];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (mode == CONTINUE && !whole) {
      float buf[NB * G] = {};
      std::memcpy(buf, out + r * ldo, ncols * sizeof(float));
      for (int j = 0; j < G * VB; ++j) acc[r][j] = vload(buf + j * VW);
      continue;
    }
#pragma GCC unroll 16
    for (int j = 0; j < G * VB; ++j) acc[r][j] = mode == CONTINUE ? vload(out + r * ldo + j * VW) : vzero();
  }
  const float* wk = w.p + b * w.bstride + k0 * w.ldw;
  for (int64_t k = k0; k < k1; ++k, wk += w.ldw) {
    vec wv[G * VB];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int v = 0; v < VB; ++v) wv[g * VB + v] = vload(wk + g * w.bstride + v * VW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vec a = vbcast(x + r * ldx + k);
#pragma GCC unroll 16
      for (int j = 0; j < G * VB; ++j) acc[r][j] = vfma(a, wv[j], acc[r][j]);
    }
  }
  if (whole) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < G * VB; ++j) {
        float* o = out + r * ldo + j * VW;
        vstore(o, mode == ADD ? vadd(vload(o), acc[r][j]) : acc[r][j]);
      }
    return;
  }
  for (int r = 0; r < R; ++r) {  // the last, partial block: through a buffer
    float buf[NB * G] = {};
    float* o = out + r * ldo;
    if (mode == ADD) std::memcpy(buf, o, ncols * sizeof(float));
    for (int j = 0; j < G * VB; ++j) vstore(buf + j * VW, mode == ADD ? vadd(vload(buf + j * VW), acc[r][j]) : acc[r][j]);
    std::memcpy(o, buf, ncols * sizeof(float));
  }
}

// k in [k0, k1): in chunks of kc from k0 (kc > 0: oneDNN's chunks, the first stored, the rest
// added), or (kc = 0) one piece of a chain that began at k = 0
template <int R, int G>
inline void tile_k(const float* x, int64_t ldx, WView w, int64_t b, int64_t k0, int64_t k1, int64_t kc, float* out,
                   int64_t ldo, int64_t ncols) {
  if (kc <= 0) return tile<R, G>(x, ldx, w, b, k0, k1, out, ldo, ncols, k0 > 0 ? CONTINUE : STORE);
  for (int64_t c = k0; c < k1; c += kc) tile<R, G>(x, ldx, w, b, c, std::min(k1, c + kc), out, ldo, ncols, c > k0 ? ADD : STORE);
}

// R rows against blocks [b0, b1), G blocks a tile while whole groups remain, then one at a time
template <int R, int G = (R == TR ? TG : tail_g(R))>
void rows_blocks(const float* x, int64_t ldx, WView w, int64_t b0, int64_t b1, int64_t N, int64_t k0, int64_t k1,
                 int64_t kc, float* o, int64_t ldo) {
  int64_t b = b0;
  for (; b + G <= b1 && (b + G) * NB <= N; b += G) tile_k<R, G>(x, ldx, w, b, k0, k1, kc, o + b * NB, ldo, NB * G);
  for (; b < b1; ++b) tile_k<R, 1>(x, ldx, w, b, k0, k1, kc, o + b * NB, ldo, std::min(NB, N - b * NB));
}

// out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times w. kc > 0: K in oneDNN's chunks of kc
// (at most 1024); kc = 0: one chain over K, a long one taken in passes with the chains stored and
// reloaded between them. Threads take groups of blocks; a group's slice of w (about 0.75 MiB) stays in L2 while each tile of
// rows, in L1, runs along it (measured on the Intel Xeon: 0.9-1.0x oneDNN's time at M 2048, K 576 /
// 1536, N 576-3072; 8-16 blocks a group ran alike).
void chain(const float* x, int64_t ldx, int64_t M, int64_t K, WView w, int64_t N, int64_t kc, float* o, int64_t ldo) {
  const int64_t nb = (N + NB - 1) / NB;
  // k per pass over the rows: one chain longer than 4096 in passes of 768 (the LM head's input gradient,
  // M 2048, reduction 49152: 1589 -> 698 ms, MKL's torch.mm 670; 256-1024 ran within 25% of that;
  // reductions of 1536-3072 ran 2-5% faster whole)
  const int64_t span = kc > 0 || K <= 4096 ? K : 768;
  const int64_t group =
      std::max<int64_t>(TG, std::min<int64_t>(16, (786432 / std::max<int64_t>(span * 64, 1)) / TG * TG));
  at::parallel_for(0, (nb + group - 1) / group, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t b0 = q * group, b1 = std::min(nb, b0 + group);
      for (int64_t k0 = 0; k0 < K; k0 += span) {
        const int64_t k1 = std::min(K, k0 + span);
        int64_t m = 0;
        for (; m + TR <= M; m += TR) rows_blocks<TR>(x + m * ldx, ldx, w, b0, b1, N, k0, k1, kc, o + m * ldo, ldo);
        const float* xr = x + m * ldx;
        float* orow = o + m * ldo;
        switch (M - m) {
          case 0: break;
          case 1: rows_blocks<1>(xr, ldx, w, b0, b1, N, k0, k1, kc, orow, ldo); break;
          case 2: rows_blocks<2>(xr, ldx, w, b0, b1, N, k0, k1, kc, orow, ldo); break;
          case 3: rows_blocks<3>(xr, ldx, w, b0, b1, N, k0, k1, kc, orow, ldo); break;
          case 4: rows_blocks<4>(xr, ldx, w, b0, b1, N, k0, k1, kc, orow, ldo); break;
          default: rows_blocks<5>(xr, ldx, w, b0, b1, N, k0, k1, kc, orow, ldo); break;
        }
      }
    }
  });
}

#if defined(__AVX512F__)
// dst[16 rows of 16] = the transpose of 16 rows of 16 at src (row stride lds)
inline void transpose16(const float* src, int64_t lds, float* dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * 16, r[i]);
}
#endif

at::Tensor pack(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat, "few_rows_f32_pack: a 2D float32 weight");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), nb = (N + NB - 1) / NB;
  at::Tensor p = at::empty({nb, K, NB}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = p.data_ptr<float>();
  // k-major: the block's rows read side by side, the packed block written in order (a copy, no
  // arithmetic; per call in the trainer, so whole 16 x 16 squares go through registers)
  at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = std::min(NB, N - b * NB);
      const float* rows = src + b * NB * K;
      float* out = dst + b * K * NB;
      int64_t k = 0;
#if defined(__AVX512F__)
      if (cols == NB)
        for (; k + 16 <= K; k += 16) transpose16(rows + k, K, out + k * NB);
#endif
      for (; k < K; ++k)
        for (int64_t c = 0; c < NB; ++c) out[k * NB + c] = c < cols ? rows[c * K + k] : 0.0f;
    }
  });
  return p;
}

void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t k_chunk, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": a 2D float32 input");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) && packed.size(2) == NB && packed.size(0) * NB >= N &&
                  (N + NB - 1) / NB == packed.size(0),
              op, ": the weight must come from few_rows_f32_pack with K = ", x.size(1), " and N = ", N);
  TORCH_CHECK(k_chunk >= 0, op, ": k_chunk must be >= 0");
}

// x [M, K] fp32, a packed weight (N given), k_chunk (0: one chain) -> [M, N] fp32
at::Tensor chain_packed(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, int64_t k_chunk) {
  check_packed(x_in, packed, N, k_chunk, "chain_f32");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor o = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    if (K == 0) return o.zero_();
    chain(x.data_ptr<float>(), x.stride(0), M, K, WView{packed.data_ptr<float>(), NB, K * NB}, N, k_chunk,
          o.data_ptr<float>(), N);
  }
  return o;
}

// The engine's decode: 1-4 rows (the same arithmetic as chain_packed; its own entry so the engine's
// callers keep their row check)
at::Tensor few_rows(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t k_chunk) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 4, "few_rows_f32: 1-4 rows, got ", x.size(0));
  return chain_packed(x, packed, N, k_chunk);
}

// x [M, N] @ w [N, K] fp32 (the input gradient grad @ W of a linear): one chain over N per output.
// w's blocks of 16 columns are copied first into [ceil(K/16)][N][16] (zeros past K): read in place,
// each step of the chain would fetch 64 bytes a row stride apart (measured 1.15x the copy's time).
at::Tensor chain_plain(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(0) &&
                  x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat,
              "chain_f32_plain: float32 x [M, N] and w [N, K]");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor w = w_in.stride(1) == 1 ? w_in : w_in.contiguous();
  const int64_t M = x.size(0), N = x.size(1), K = w.size(1), nb = (K + NB - 1) / NB;
  at::Tensor o = at::empty({M, K}, x.options());
  if (M == 0 || K == 0) return o;
  if (N == 0) return o.zero_();
  at::Tensor p = at::empty({nb, N, NB}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = p.data_ptr<float>();
  const int64_t ldw = w.stride(0);
  at::parallel_for(0, nb, 1, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = std::min(NB, K - b * NB);
      float* out = dst + b * N * NB;
      for (int64_t n = 0; n < N; ++n) {
        std::memcpy(out + n * NB, src + n * ldw + b * NB, cols * sizeof(float));
        if (cols < NB) std::memset(out + n * NB + cols, 0, (NB - cols) * sizeof(float));
      }
    }
  });
  chain(x.data_ptr<float>(), x.stride(0), M, N, WView{dst, NB, N * NB}, K, 0, o.data_ptr<float>(), K);
  return o;
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("few_rows_f32_form() -> str", &titan_rl::form);
  m.def("few_rows_f32_pack(Tensor weight) -> Tensor", &titan_rl::pack);
  m.def("few_rows_f32(Tensor x, Tensor packed, int n, int k_chunk=0) -> Tensor", &titan_rl::few_rows);
  m.def("chain_f32(Tensor x, Tensor packed, int n, int k_chunk=0) -> Tensor", &titan_rl::chain_packed);
  m.def("chain_f32_plain(Tensor x, Tensor w) -> Tensor", &titan_rl::chain_plain);
}
