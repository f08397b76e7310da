// Causal GQA attention over a paged KV cache, one fixed reduction order per row.
//
// A row = (one query token, one query head). Its output is computed from its own query,
// its sequence's keys/values at positions 0..pos (pos = its absolute position) and
// nothing else, in an order fixed by pos alone:
//   scores s_j = ((P0 + P1) + (P2 + P3)) * scale, j = 0..pos, P_c = fma-accumulated in
//     order over d = c, c+4, c+8, ... (four independent chains) of q_d k_jd;
//   m = max_j s_j; p_j = exp_f(s_j - m);
//   l = sum_j p_j in LANES lanes (j mod LANES) + tree;  acc = fma(p_j, v_j, acc), j ascending;
//   out = acc / l, rounded to the query dtype.
// So the trainer's dense causal forward, the engine's prefill, chunked prefill, decode
// and prefix-cache hits give a row the same bits, whatever else shares the call.
//
// Layout. Keys are stored TRANSPOSED within a page ([D, page] per page and kv head), so
// the scores of LANES consecutive positions are LANES independent sums, one vector FMA
// per d, with no horizontal reduction; values stay [page, D]. The engine's cache write
// (kernels/attention/torch_impl.py kv_cache_write) stores them so; the trainer passes its
// dense keys and values as a copy in pages of 64 positions. (The bf16 form below stores
// both in pairs instead.) Keys and values are read in place through the page table. Scores of
// slots past a row's position may be computed from uninitialised memory (the last
// LANES-block) but are never used: lanes are independent, nothing mixes them in.
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TITAN_RL_ATTN_DPBF16 1
#endif

namespace titan_rl {
namespace {

// query tokens of one sequence sharing each key/value load: the fp32 form / the bf16 form
// (whose passes are cheaper, so the K/V traffic of small tiles dominated at long prompts)
constexpr int64_t QTILE = 4, QTILE_BF16 = 16, QTILE_MAX = 16;

template <typename C>
inline const float* row_f32(const C* src, float* buf, int64_t D) {
  for (int64_t d = 0; d < D; ++d) buf[d] = to_f(src[d]);
  return buf;
}
template <>
inline const float* row_f32<float>(const float* src, float*, int64_t) { return src; }

// p_j = exp(s_j - max s) in place over n scores; returns sum_j p_j (j mod LANES lanes, tree)
// and stores max s in *m_out.
inline float softmax_weights(float* __restrict sg, int64_t n, float* m_out) {
  // the max over LANES lanes, then across them: a max is exact in any order, and one running
  // max is a serial chain the compiler cannot vectorise (it was a fifth of the bf16 form's time)
  float lm[LANES];
  for (int l = 0; l < LANES; ++l) lm[l] = sg[0];
  const int64_t full_m = n - n % LANES;
  for (int64_t j0 = 0; j0 < full_m; j0 += LANES)
    for (int l = 0; l < LANES; ++l) lm[l] = sg[j0 + l] > lm[l] ? sg[j0 + l] : lm[l];
  for (int64_t j = full_m; j < n; ++j) lm[0] = sg[j] > lm[0] ? sg[j] : lm[0];
  float m = lm[0];
  for (int l = 1; l < LANES; ++l) m = lm[l] > m ? lm[l] : m;
  *m_out = m;
  for (int64_t j = 0; j < n; ++j) sg[j] = exp_f(sg[j] - m);
  float lanes[LANES];
  for (int l = 0; l < LANES; ++l) lanes[l] = 0.0f;
  const int64_t full = n - n % LANES;
  for (int64_t j0 = 0; j0 < full; j0 += LANES)
    for (int l = 0; l < LANES; ++l) lanes[l] = lanes[l] + sg[j0 + l];
  for (int64_t j = full; j < n; ++j) lanes[j - full] = lanes[j - full] + sg[j];
  return lane_tree(lanes);
}

// For each of NR rows r (accumulators DC apart, weights pstride apart):
// acc_r[d] = fma(p_r[j], v_j[d], acc_r[d]) for j = 0..n-1 in order (v rows of DC floats). The
// accumulators stay in registers for the usual head sizes; rows sharing a call share each
// value load, and each row's FMAs are those it would run alone.
template <int DC, int NR = 1>
inline void accumulate_fixed(float* __restrict acc, const float* __restrict p, int64_t pstride,
                             const float* __restrict v, int64_t n) {
  float a[NR][DC];
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < DC; ++d) a[r][d] = acc[r * DC + d];
  for (int64_t j = 0; j < n; ++j) {
    float w[NR];
    for (int r = 0; r < NR; ++r) w[r] = p[r * pstride + j];
    const float* vj = v + j * DC;
    for (int d = 0; d < DC; ++d)
      for (int r = 0; r < NR; ++r) a[r][d] = __builtin_fmaf(w[r], vj[d], a[r][d]);
  }
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < DC; ++d) acc[r * DC + d] = a[r][d];
}

inline void accumulate_rows(float* __restrict acc, const float* __restrict p, const float* __restrict v, int64_t n,
                            int64_t D) {
  switch (D) {
    case 64: return accumulate_fixed<64>(acc, p, 0, v, n);
    case 128: return accumulate_fixed<128>(acc, p, 0, v, n);
    case 256: return accumulate_fixed<256>(acc, p, 0, v, n);
    default:
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) acc[d] = __builtin_fmaf(p[j], v[j * D + d], acc[d]);
  }
}

#ifdef TITAN_RL_ATTN_DPBF16
// The bf16 form (bf16 queries and cache, D a multiple of 32, the CPU has AVX512-BF16;
// chosen per call by the caller, reported by the self-check): the same three passes, with
// the CPU's bf16 dot product (vdpbf16ps: two exact bf16 products added to an fp32 lane, in
// the instruction's fixed order; subnormal inputs read as 0) in place of fp32 FMAs:
//   scores s_j = ((A0 + A1) + (A2 + A3)) * scale, A_c = vdpbf16ps-accumulated in order over
//     the d-pairs c, c+4, c+8, ... of (q_2p k_j,2p + q_2p+1 k_j,2p+1);
//   m, p_j, l as in the fp32 form (p_j and l in fp32);
//   acc = vdpbf16ps over position pairs (j, j+1), j = 0, 2, 4, ... (p rounded to bf16),
//     a last unpaired position (n odd) by one fp32 FMA of bf16(p_j) and v_j;
//   out = acc / l, rounded to bf16.
// Every step is fixed by the row's own n, so the invariance argument is the fp32 form's.

// Scores of one row at LANES positions; kp: the block's first d-pair (16 positions x 2
// bf16, 64 bytes), the next d-pair pstride elements on (the cache's pair layout).
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// NR rows (qpairs NR rows of D/2 pairs, DP apart) at once: the rows share each key load and
// their 4 * NR chains keep the dot-product unit busy (one row's 4 chains wait on the
// instruction's latency). Each row's operations and their order are the one-row form's.
template <int NR>
inline void block_scores_dpbf16(const uint32_t* __restrict qpairs, int64_t DP, const uint16_t* __restrict kp,
                                int64_t pstride, int64_t D, float scale, float* __restrict out, int64_t ostride) {
  __m512 a[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; p += 4) {
    const uint16_t* k = kp + p * pstride;
    const __m512bh k0 = load_bh(k), k1 = load_bh(k + pstride), k2 = load_bh(k + 2 * pstride),
                   k3 = load_bh(k + 3 * pstride);
    for (int r = 0; r < NR; ++r) {
      const uint32_t* q = qpairs + r * DP + p;
      a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[0])), k0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[1])), k1);
      a[r][2] = _mm512_dpbf16_ps(a[r][2], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[2])), k2);
      a[r][3] = _mm512_dpbf16_ps(a[r][3], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[3])), k3);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const __m512 s =
        _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3])), _mm512_set1_ps(scale));
    _mm512_storeu_ps(out + r * ostride, s);
  }
}

// acc[D] += sum over positions [0, jn) of a block: position pairs from vp (the block's
// first pair, [D, 2] bf16, in the cache's pair layout), weights pb (bf16 bits of p); an
// odd last position (even index: the low halves of its pair) by fp32 FMA.
// NR rows at once (acc rows DC apart, weight rows wstride apart), sharing each value load;
// each row's operations and their order are the same as alone.
template <int DC, int NR>
inline void accumulate_dpbf16(float* __restrict acc, const uint16_t* __restrict pb, int64_t wstride,
                              const uint16_t* __restrict vp, int64_t jn) {
  constexpr int NV = DC / 16;
  __m512 a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = _mm512_loadu_ps(acc + r * DC + 16 * c);
  const int64_t pairs = jn / 2;
  for (int64_t t = 0; t < pairs; ++t) {
    const uint16_t* v = vp + t * DC * 2;
    __m512bh vb[NV];
    for (int c = 0; c < NV; ++c) vb[c] = load_bh(v + 32 * c);
    for (int r = 0; r < NR; ++r) {
      const uint16_t* w2 = pb + r * wstride + 2 * t;
      const uint32_t w = static_cast<uint32_t>(w2[0]) | (static_cast<uint32_t>(w2[1]) << 16);
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
      for (int c = 0; c < NV; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], wb, vb[c]);
    }
  }
  if (jn & 1) {
    const uint16_t* v = vp + pairs * DC * 2;
    for (int r = 0; r < NR; ++r) {
      const __m512 w = _mm512_set1_ps(bf16_to_f(pb[r * wstride + jn - 1]));
      for (int c = 0; c < NV; ++c) {
        const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(v + 32 * c), 16));
        a[r][c] = _mm512_fmadd_ps(w, x, a[r][c]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + r * DC + 16 * c, a[r][c]);
}

// Rows per group in pass 3: accumulators of up to 64 floats per row x 4 rows stay in registers.
constexpr int64_t group_rows(int64_t D) { return D <= 64 ? 4 : (D <= 128 ? 2 : 1); }

// nr (<= group_rows(D)) consecutive rows with the same jn.
inline void accumulate_rows_dpbf16(float* acc, const uint16_t* pb, int64_t wstride, const uint16_t* vp, int64_t jn,
                                   int64_t D, int64_t nr) {
  switch (D * 8 + nr) {
#define TITAN_ATTN_D(n, k) \
  case n * 8 + k: return accumulate_dpbf16<n, k>(acc, pb, wstride, vp, jn);
#define TITAN_ATTN_D4(n) TITAN_ATTN_D(n, 1) TITAN_ATTN_D(n, 2) TITAN_ATTN_D(n, 3) TITAN_ATTN_D(n, 4)
#define TITAN_ATTN_D2(n) TITAN_ATTN_D(n, 1) TITAN_ATTN_D(n, 2)
    TITAN_ATTN_D4(16) TITAN_ATTN_D4(32) TITAN_ATTN_D4(48) TITAN_ATTN_D4(64) TITAN_ATTN_D2(80) TITAN_ATTN_D2(96)
    TITAN_ATTN_D2(112) TITAN_ATTN_D2(128) TITAN_ATTN_D(144, 1) TITAN_ATTN_D(160, 1) TITAN_ATTN_D(176, 1)
    TITAN_ATTN_D(192, 1) TITAN_ATTN_D(208, 1) TITAN_ATTN_D(224, 1) TITAN_ATTN_D(240, 1) TITAN_ATTN_D(256, 1)
#undef TITAN_ATTN_D2
#undef TITAN_ATTN_D4
#undef TITAN_ATTN_D
    default: TORCH_CHECK(false, "paged_attention: the bf16 form takes head_dim <= 256 (a multiple of 16)");
  }
}
#endif

bool dpbf16_form_available() {
#ifdef TITAN_RL_ATTN_DPBF16
  return true;
#else
  return false;
#endif
}


#ifdef TITAN_RL_ATTN_DPBF16
// One tile (nt query tokens x G heads of kv head h) in the bf16 form, over a cache in the
// pair layout (kv_cache_write with pairs): acc [R, D] and lsum [R] out; the caller
// divides and rounds.
inline void attention_tile_dpbf16(const c10::BFloat16* q, int64_t q_t, int64_t q_h, const c10::BFloat16* kc,
                                  const c10::BFloat16* vc, const int64_t* k_st, const int64_t* v_st,
                                  const int64_t* row_bt, int64_t page, int64_t h, int64_t G, int64_t D, int64_t t0,
                                  int64_t nt, const int64_t* n_row, int64_t n_max, int64_t n_pad, float scale,
                                  uint32_t* qp, float* sc, std::vector<uint16_t>& pbuf, float* lsum, float* rmax,
                                  float* acc) {
  const int64_t R = nt * G, DP = D / 2;
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t g = 0; g < G; ++g)
      std::memcpy(qp + (i * G + g) * DP, q + (t0 + i) * q_t + (h * G + g) * q_h, D * sizeof(uint16_t));
  // Pass 1: scores; a block's d-pair p is 64 contiguous bytes, the next p a page on.
  for (int64_t j0 = 0; j0 < n_max; j0 += LANES) {
    const uint16_t* kp =
        reinterpret_cast<const uint16_t*>(kc + row_bt[j0 / page] * k_st[0] + h * k_st[1]) + (j0 % page) * 2;
    int64_t r_end = 0;
    for (int64_t i = 0; i < nt; ++i)
      if (n_row[i] > j0) r_end = (i + 1) * G;
    int64_t r = 0;
    for (; r + 4 <= r_end; r += 4)
      block_scores_dpbf16<4>(qp + r * DP, DP, kp, 2 * page, D, scale, sc + r * n_pad + j0, n_pad);
    for (; r < r_end; ++r) block_scores_dpbf16<1>(qp + r * DP, DP, kp, 2 * page, D, scale, sc + r * n_pad + j0, n_pad);
  }
  // Pass 2: softmax weights (fp32) and their sum; the weights rounded to bf16 for pass 3.
  pbuf.resize(R * n_pad);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = n_row[r / G];
    float* sr = sc + r * n_pad;
    lsum[r] = softmax_weights(sr, n, rmax + r);
    for (int64_t j = 0; j < n; ++j) pbuf[r * n_pad + j] = f_to_bf16(sr[j]);
  }
  // Pass 3: a block's position pairs are consecutive [D, 2] runs.
  for (int64_t i = 0; i < R * D; ++i) acc[i] = 0.0f;
  for (int64_t j0 = 0; j0 < n_max; j0 += LANES) {
    const uint16_t* vp =
        reinterpret_cast<const uint16_t*>(vc + row_bt[j0 / page] * v_st[0] + h * v_st[1]) + (j0 % page) * D;
    const int64_t j1 = std::min(j0 + LANES, n_max);
    // rows in order (token-major), in groups of consecutive rows that see the same positions
    // of this block (jn grows with the token; within full blocks it is LANES for all)
    const int64_t gmax = group_rows(D);
    for (int64_t r = 0; r < R;) {
      const int64_t jn = std::min(j1, n_row[r / G]) - j0;
      if (jn <= 0) {
        ++r;
        continue;
      }
      int64_t nr = 1;
      while (nr < gmax && r + nr < R && std::min(j1, n_row[(r + nr) / G]) - j0 == jn) ++nr;
      accumulate_rows_dpbf16(acc + r * D, pbuf.data() + r * n_pad + j0, n_pad, vp, jn, D, nr);
      r += nr;
    }
  }
}
#endif

// Scores of NR rows (q rows D apart) at LANES positions from a [D, LANES] key block (rows
// kstride apart): per row four partial sums over d mod 4 (independent dependency chains),
// then (a0 + a1) + (a2 + a3). The rows share each key load; each row's operations and
// their order are the one-row form's.
template <int NR>
inline void scores_f32(const float* __restrict q, int64_t D, const float* __restrict kb, int64_t kstride, float scale,
                       float* __restrict out, int64_t ostride) {
  float a[NR][4][LANES];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < LANES; ++l) a[r][c][l] = 0.0f;
  for (int64_t d = 0; d < D; d += 4) {
    const float *k0 = kb + d * kstride, *k1 = k0 + kstride, *k2 = k1 + kstride, *k3 = k2 + kstride;
    for (int r = 0; r < NR; ++r) {
      const float* qr = q + r * D + d;
      const float q0 = qr[0], q1 = qr[1], q2 = qr[2], q3 = qr[3];
      for (int l = 0; l < LANES; ++l) {
        a[r][0][l] = __builtin_fmaf(q0, k0[l], a[r][0][l]);
        a[r][1][l] = __builtin_fmaf(q1, k1[l], a[r][1][l]);
        a[r][2][l] = __builtin_fmaf(q2, k2[l], a[r][2][l]);
        a[r][3][l] = __builtin_fmaf(q3, k3[l], a[r][3][l]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int l = 0; l < LANES; ++l)
      out[r * ostride + l] = ((a[r][0][l] + a[r][1][l]) + (a[r][2][l] + a[r][3][l])) * scale;
}

// Rows of the fp32 form sharing each key load (scores) and, at D = 64, each value load: two
// rows' accumulators (2 x 4 x LANES, or 2 x 64 floats) fit the 32 vector registers of
// AVX-512, not AVX2's 16; there one row at a time.
#ifdef __AVX512F__
constexpr int ROWS_F32 = 2;
#else
constexpr int ROWS_F32 = 1;
#endif

// Work items: (sequence, first query token, end) tiles of <= qtile tokens, times kv heads.
// A row's arithmetic is the same whichever tile it is in: each tile member only skips
// the positions past its own.
template <typename TQ, typename C>
void attention_rows(const TQ* q, int64_t q_t, int64_t q_h, const C* kc, const C* vc, const int64_t* k_st,
                    const int64_t* v_st, const int64_t* qsl, const int64_t* seq_lens, const int64_t* bt,
                    int64_t bt_s, int64_t page, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale,
                    TQ* out, bool dots, float* lse) {
  const int64_t G = H / Hkv;
#ifdef TITAN_RL_ATTN_DPBF16
  constexpr bool BF16_BOTH = std::is_same_v<TQ, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  constexpr bool BF16_BOTH = false;
  (void)dots;
#endif
  const int64_t qtile = BF16_BOTH && dots ? QTILE_BF16 : QTILE;
  std::vector<int64_t> tiles;  // (s, t0, t1) triples
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = qsl[s]; t < qsl[s + 1]; t += qtile) {
      tiles.push_back(s);
      tiles.push_back(t);
      tiles.push_back(std::min(t + qtile, qsl[s + 1]));
    }
  const int64_t n_tiles = static_cast<int64_t>(tiles.size()) / 3;
  at::parallel_for(0, n_tiles * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(qtile * G * D), acc(qtile * G * D), sc, lsum(qtile * G), rmax(qtile * G);
    std::vector<float> kblk(D * LANES), vblk(LANES * D);
#ifdef TITAN_RL_ATTN_DPBF16
    std::vector<uint32_t> qp(BF16_BOTH && dots ? qtile * G * D / 2 : 0);
    std::vector<uint16_t> pbuf;
#endif
    int64_t n_row[QTILE_MAX];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % Hkv, tile = item / Hkv;
      const int64_t s = tiles[3 * tile], t0 = tiles[3 * tile + 1], t1 = tiles[3 * tile + 2];
      const int64_t nt = t1 - t0, R = nt * G;
      const int64_t first_pos = seq_lens[s] - (qsl[s + 1] - qsl[s]) + (t0 - qsl[s]);
      for (int64_t i = 0; i < nt; ++i) n_row[i] = first_pos + i + 1;
      const int64_t n_max = n_row[nt - 1];
      const int64_t n_pad = (n_max + LANES - 1) / LANES * LANES;
      sc.resize(R * n_pad);
      for (int64_t i = 0; i < nt; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const TQ* qr = q + (t0 + i) * q_t + (h * G + g) * q_h;
          for (int64_t d = 0; d < D; ++d) qf[(i * G + g) * D + d] = to_f(qr[d]);
        }
      const int64_t* row_bt = bt + s * bt_s;
#ifdef TITAN_RL_ATTN_DPBF16
      if constexpr (BF16_BOTH) {
        if (dots) {
          attention_tile_dpbf16(q, q_t, q_h, kc, vc, k_st, v_st, row_bt, page, h, G, D, t0, nt, n_row, n_max, n_pad,
                                scale, qp.data(), sc.data(), pbuf, lsum.data(), rmax.data(), acc.data());
          for (int64_t i = 0; i < nt; ++i)
            for (int64_t g = 0; g < G; ++g) {
              const int64_t r = i * G + g;
              TQ* o = out + (t0 + i) * H * D + (h * G + g) * D;
              const float l = lsum[r];
              for (int64_t d = 0; d < D; ++d) o[d] = from_f<TQ>(acc[r * D + d] / l);
              if (lse) lse[(t0 + i) * H + h * G + g] = rmax[r] + std::log(l);
            }
          continue;
        }
      }
#endif
      // Pass 1: scores, LANES positions at a time from the transposed keys.
      for (int64_t j0 = 0; j0 < n_max; j0 += LANES) {
        const C* kt = kc + row_bt[j0 / page] * k_st[0] + h * k_st[1] + (j0 % page);
        int64_t r_end = 0;  // rows [0, r_end) see position j0
        for (int64_t i = 0; i < nt; ++i)
          if (n_row[i] > j0) r_end = (i + 1) * G;
        const float* kb;
        int64_t kstride;
        if constexpr (std::is_same_v<C, float>) {
          kb = kt;
          kstride = k_st[2];
        } else {  // widen the [D, LANES] block once for all rows of the tile
          for (int64_t d = 0; d < D; ++d)
            for (int l = 0; l < LANES; ++l) kblk[d * LANES + l] = to_f(kt[d * k_st[2] + l]);
          kb = kblk.data();
          kstride = LANES;
        }
        int64_t r = 0;
        for (; r + ROWS_F32 <= r_end; r += ROWS_F32)
          scores_f32<ROWS_F32>(qf.data() + r * D, D, kb, kstride, scale, sc.data() + r * n_pad + j0, n_pad);
        for (; r < r_end; ++r) scores_f32<1>(qf.data() + r * D, D, kb, kstride, scale, sc.data() + r * n_pad + j0, n_pad);
      }
      // Pass 2: softmax weights and their sum, per row over its own n.
      for (int64_t r = 0; r < R; ++r) lsum[r] = softmax_weights(sc.data() + r * n_pad, n_row[r / G], rmax.data() + r);
      // Pass 3: acc = sum_j p_j v_j (fma, j ascending); each value row loaded once for
      // all rows of the tile.
      for (int64_t i = 0; i < R * D; ++i) acc[i] = 0.0f;
      // LANES positions at a time (a block never crosses a page: pages are multiples of
      // LANES): the block's value rows widened once, then each row accumulates over them
      // (positions ascending: the same FMAs as one loop over j).
      for (int64_t j0 = 0; j0 < n_max; j0 += LANES) {
        const C* vb = vc + row_bt[j0 / page] * v_st[0] + h * v_st[1] + (j0 % page) * v_st[2];
        const int64_t j1 = std::min(j0 + LANES, n_max);
        const float* vf;
        if (std::is_same_v<C, float> && v_st[2] == D) {
          vf = reinterpret_cast<const float*>(vb);
        } else {
          for (int64_t j = j0; j < j1; ++j)
            for (int64_t d = 0; d < D; ++d) vblk[(j - j0) * D + d] = to_f(vb[(j - j0) * v_st[2] + d]);
          vf = vblk.data();
        }
        for (int64_t i = 0; i < nt; ++i) {
          const int64_t jn = std::min(j1, n_row[i]) - j0;
          if (jn <= 0) continue;
          int64_t g = 0;
          if (ROWS_F32 == 2 && D == 64)  // two heads of the token share each value load
            for (; g + 2 <= G; g += 2) {
              const int64_t r = i * G + g;
              accumulate_fixed<64, 2>(acc.data() + r * D, sc.data() + r * n_pad + j0, n_pad, vf, jn);
            }
          for (; g < G; ++g) {
            const int64_t r = i * G + g;
            accumulate_rows(acc.data() + r * D, sc.data() + r * n_pad + j0, vf, jn, D);
          }
        }
      }
      for (int64_t i = 0; i < nt; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          TQ* o = out + (t0 + i) * H * D + (h * G + g) * D;
          const float l = lsum[r];
          for (int64_t d = 0; d < D; ++d) o[d] = from_f<TQ>(acc[r * D + d] / l);
          if (lse) lse[(t0 + i) * H + h * G + g] = rmax[r] + std::log(l);
        }
    }
  });
}

// q [T, H, D]; k_cache [pages, Hkv, D, page] (keys transposed, slots contiguous);
// v_cache [pages, Hkv, page, D] (rows contiguous); query_start_loc [S+1]; seq_lens [S]
// (KV length including this call's tokens); block_table [S, max_pages]. page must be a
// multiple of LANES. Returns [T, H, D] in q's dtype.
std::tuple<at::Tensor, at::Tensor> attention_core(const at::Tensor& q_in, const at::Tensor& k_cache,
                                                 const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                                                 const at::Tensor& seq_lens, const at::Tensor& block_table,
                                                 double scale, bool bf16_dots, bool want_lse) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_attention: bad ranks");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "paged_attention: cache rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: k/v dtypes differ");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), page = k_cache.size(3);
  TORCH_CHECK(D % LANES == 0, "paged_attention: head_dim ", D, " must be a multiple of ", LANES);
  TORCH_CHECK(page % LANES == 0, "paged_attention: page ", page, " must be a multiple of ", LANES);
  // (v_cache may hold fewer slots per page than k_cache: the trainer's one-page-per-
  // sequence view of L positions against keys padded to a multiple of LANES.)
  TORCH_CHECK(k_cache.size(2) == D && v_cache.size(2) <= page && v_cache.size(3) == D,
              "paged_attention: k_cache must be [pages, Hkv, D, page], v_cache [pages, Hkv, page, D]");
  TORCH_CHECK(H % Hkv == 0, "paged_attention: heads ", H, " not a multiple of kv heads ", Hkv);
  const at::Tensor qsl = query_start_loc.to(at::kLong).contiguous();
  const at::Tensor sl = seq_lens.to(at::kLong).contiguous();
  const at::Tensor bt = block_table.to(at::kLong).contiguous();
  const int64_t S = sl.size(0);
  at::Tensor out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  // lse [T, H]: the row's log-sum-exp of its scaled scores (max + log of the weights' sum), for
  // the trainer's backward (SDPA's flash backward takes it instead of recomputing the forward)
  at::Tensor lse = want_lse ? at::empty({T, H}, q.options().dtype(at::kFloat)) : at::Tensor();
  const int64_t kst[3] = {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};  // page, head, d
  const int64_t vst[3] = {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  const float sc = static_cast<float>(scale);
  // bf16_dots: the caller chose the bf16 form, whose cache is in the pair layout
  const bool dots = bf16_dots;
  TORCH_CHECK(!dots || (dpbf16_form_available() && D <= 256 && q.scalar_type() == at::kBFloat16 &&
                        k_cache.scalar_type() == at::kBFloat16 && k_cache.stride(2) == page && v_cache.stride(2) == D),
              "paged_attention: the bf16 form takes bf16 queries and a bf16 cache in the pair layout, head_dim <= 256, "
              "on a CPU with AVX512-BF16");
#define TITAN_ATTN(TQ, TC)                                                                                         \
  attention_rows<TQ, TC>(q.data_ptr<TQ>(), q.stride(0), q.stride(1), k_cache.data_ptr<TC>(),                      \
                         v_cache.data_ptr<TC>(), kst, vst, qsl.data_ptr<int64_t>(), sl.data_ptr<int64_t>(),          \
                         bt.data_ptr<int64_t>(), bt.size(1), page, S, H, Hkv, D, sc, out.data_ptr<TQ>(), dots, \
                         want_lse ? lse.data_ptr<float>() : nullptr)
  const bool qb = q.scalar_type() == at::kBFloat16, cb = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK((qb || q.scalar_type() == at::kFloat) && (cb || k_cache.scalar_type() == at::kFloat),
              "paged_attention: float32 or bfloat16 only");
  if (qb && cb) TITAN_ATTN(c10::BFloat16, c10::BFloat16);
  else if (qb) TITAN_ATTN(c10::BFloat16, float);
  else if (cb) TITAN_ATTN(float, c10::BFloat16);
  else TITAN_ATTN(float, float);
#undef TITAN_ATTN
  return {out, lse};
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& block_table, double scale, bool bf16_dots) {
  return std::get<0>(attention_core(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, bf16_dots,
                                    false));
}

std::tuple<at::Tensor, at::Tensor> paged_attention_lse(const at::Tensor& q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                                                       const at::Tensor& seq_lens, const at::Tensor& block_table,
                                                       double scale, bool bf16_dots) {
  return attention_core(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, bf16_dots, true);
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_table, float scale, bool bf16_dots=False) -> Tensor",
        &titan_rl::paged_attention);
  m.def("paged_attention_lse(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_table, float scale, bool bf16_dots=False) -> (Tensor, Tensor)",
        &titan_rl::paged_attention_lse);
  m.def("paged_attention_dpbf16_available() -> bool", &titan_rl::dpbf16_form_available);
}
