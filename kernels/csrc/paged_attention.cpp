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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define TITAN_RL_ATTN_AMX 1
#endif
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

#ifdef TITAN_RL_ATTN_DPBF16
// exp_f (common.h) on 16 lanes: the same IEEE operations in the same order (the clamps as
// max / min with the scalar form's NaN behaviour: vmaxps returns its second operand when
// unordered), so every lane has the scalar function's bits.
// NONPOS: x <= 0 or NaN (a score minus the scores' max), where the upper clamp is the identity.
template <bool NONPOS = false>
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  if (!NONPOS) x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
  const __m512 big = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), big), big);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, z), r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// f_to_bf16 on 16 lanes (round to nearest even, NaN to 0x7FC0), narrowed to 16 bf16. Where
// every lane is a normal number (the softmax weights but for the clamp's ~2^-126 end),
// vcvtneps2bf16's rounding is the same (its NaN and subnormal rules are not): one instruction.
inline __m256i bf16x16(__m512 f) {
  if (_mm512_cmp_ps_mask(_mm512_abs_ps(f), _mm512_set1_ps(1.17549435e-38f), _CMP_GE_OQ) == 0xFFFF)
    return (__m256i)_mm512_cvtneps_pbh(f);
  const __m512i b = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// The bf16 forms' pass 2 for one row: softmax_weights over s_j * scale (SCALE) or s_j, with
// the weights rounded to bf16 into pb[0, n) instead of stored; the same operations and order
// (the max over LANES lanes then a tail in lane 0, the sum over lanes then the tree).
template <bool SCALE>
inline float softmax_weights_bf16(const float* __restrict sg, int64_t n, float scale, float* m_out,
                                  uint16_t* __restrict pb) {
  const __m512 sv = _mm512_set1_ps(scale);
  auto at = [&](int64_t j) { return SCALE ? sg[j] * scale : sg[j]; };
  const int64_t full = n - n % LANES;
  __m512 lm = _mm512_set1_ps(at(0));
  for (int64_t j0 = 0; j0 < full; j0 += LANES) {
    __m512 x = _mm512_loadu_ps(sg + j0);
    if (SCALE) x = _mm512_mul_ps(x, sv);
    lm = _mm512_max_ps(x, lm);  // x > lm ? x : lm
  }
  float lmv[LANES];
  _mm512_storeu_ps(lmv, lm);
  for (int64_t j = full; j < n; ++j) lmv[0] = at(j) > lmv[0] ? at(j) : lmv[0];
  float m = lmv[0];
  for (int l = 1; l < LANES; ++l) m = lmv[l] > m ? lmv[l] : m;
  *m_out = m;
  const __m512 mv = _mm512_set1_ps(m);
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < full; j0 += LANES) {
    __m512 x = _mm512_loadu_ps(sg + j0);
    if (SCALE) x = _mm512_mul_ps(x, sv);
    const __m512 e = exp16<true>(_mm512_sub_ps(x, mv));
    lanes = _mm512_add_ps(lanes, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j0), bf16x16(e));
  }
  if (full < n) {  // the tail: lanes 0..n-full-1, the others untouched
    const __mmask16 k = static_cast<__mmask16>((1u << (n - full)) - 1u);
    __m512 x = _mm512_maskz_loadu_ps(k, sg + full);
    if (SCALE) x = _mm512_mul_ps(x, sv);
    const __m512 e = exp16<true>(_mm512_sub_ps(x, mv));
    lanes = _mm512_mask_add_ps(lanes, k, lanes, e);
    _mm256_mask_storeu_epi16(pb + full, k, bf16x16(e));
  }
  float lv[LANES];
  _mm512_storeu_ps(lv, lanes);
  return lane_tree(lv);
}
#endif

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

#ifdef TITAN_RL_ATTN_DPBF16
// The pair layout's key block at position j0 (a multiple of LANES): d-pair p's 16 positions x 2
// are 64 contiguous bytes, the next d-pair 2 * page elements on.
inline const uint16_t* key_pairs(const c10::BFloat16* kc, const int64_t* k_st, const int64_t* row_bt, int64_t page,
                                 int64_t h, int64_t j0) {
  return reinterpret_cast<const uint16_t*>(kc + row_bt[j0 / page] * k_st[0] + h * k_st[1]) + (j0 % page) * 2;
}
#endif

// Rows [0, r_end) of a tile (nt tokens x G heads, token-major) see position j0.
inline int64_t rows_seeing(const int64_t* n_row, int64_t nt, int64_t G, int64_t j0) {
  int64_t r_end = 0;
  for (int64_t i = 0; i < nt; ++i)
    if (n_row[i] > j0) r_end = (i + 1) * G;
  return r_end;
}

bool dpbf16_form_available() {
#ifdef TITAN_RL_ATTN_DPBF16
  return true;
#else
  return false;
#endif
}

// The amx form needs the instructions in the binary (a -march=native build on an AMX CPU) and
// the OS's leave to use the tiles' register state, which Linux grants a process on request.
bool amx_form_available() {
#ifdef TITAN_RL_ATTN_AMX
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
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
    const uint16_t* kp = key_pairs(kc, k_st, row_bt, page, h, j0);
    const int64_t r_end = rows_seeing(n_row, nt, G, j0);
    int64_t r = 0;
    for (; r + 4 <= r_end; r += 4)
      block_scores_dpbf16<4>(qp + r * DP, DP, kp, 2 * page, D, scale, sc + r * n_pad + j0, n_pad);
    for (; r < r_end; ++r) block_scores_dpbf16<1>(qp + r * DP, DP, kp, 2 * page, D, scale, sc + r * n_pad + j0, n_pad);
  }
  // Pass 2: softmax weights (fp32) and their sum; the weights rounded to bf16 for pass 3.
  pbuf.resize(R * n_pad);
  for (int64_t r = 0; r < R; ++r)
    lsum[r] = softmax_weights_bf16<false>(sc + r * n_pad, n_row[r / G], 1.0f, rmax + r, pbuf.data() + r * n_pad);
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

#ifdef TITAN_RL_ATTN_AMX
// The amx form (bf16 queries and cache in the pair layout, the CPU has AMX-BF16; chosen per
// call by the caller). Its arithmetic is what one tdpbf16ps computes per output (read off
// the instruction's outputs, docs/kernels.md "The amx form"): over its k-pairs in order, the
// even products summed in one fp32 chain from +0, the odd products in another, then
// C + (even + odd), every add rounded to nearest, subnormals flushed. So, per row:
//   scores s_j = C * scale, C = sum over 32-dim chunks (16 d-pairs, the last one 8 when D is
//     not a multiple of 32) of (E + O) in chunk order, E / O the chains over the chunk's even
//     / odd dims of q_d k_jd;
//   m, p_j, l as in the fp32 form; p_j rounded to bf16 (+0 past the row's position);
//   acc_d = sum over 16-position blocks (at absolute positions 16b) of (E + O) in block
//     order, E / O the chains over the block's even / odd positions of p_j v_jd;
//   out = acc / l, rounded to bf16.
// Everything is fixed by the row's own position: each output of a tile operation depends on
// its own row of A and column of B only, so the rows sharing a tile (up to 16, padded with
// zero queries) and the threads change nothing. Positions past a row's own within its last
// block add (+0 * v) = +-0 to chains that start at +0, which leaves them unchanged: those v
// are cache entries of this call's or earlier tokens (finite for a finite model); slots past
// the tile's last position may be uninitialised memory and are read from a zeroed copy.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t AMX_ROWS = 16;

// One tile configuration for both passes (loaded once per thread's share of the work: loading
// one costs more than a short decode's tile operations): tmm0-3 accumulators (16 rows x 16
// fp32); tmm4 / tmm5 a 16-pair A / B, tmm6 / tmm7 an 8-pair A / B (the scores' short last chunk
// and every value-pass step: 16 positions are 8 pairs). D is a multiple of 16, so a last chunk
// has 8 or 16 pairs.
inline void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = AMX_ROWS, c.colsb[t] = 64;
  c.rows[4] = AMX_ROWS, c.colsb[4] = 64;
  c.rows[5] = 16, c.colsb[5] = 64;
  c.rows[6] = AMX_ROWS, c.colsb[6] = 32;
  c.rows[7] = 8, c.colsb[7] = 64;
  _tile_loadconfig(&c);
}

inline void attention_tile_amx(const c10::BFloat16* q, int64_t q_t, int64_t q_h, const c10::BFloat16* kc,
                               const c10::BFloat16* vc, const int64_t* k_st, const int64_t* v_st,
                               const int64_t* row_bt, int64_t page, int64_t h, int64_t G, int64_t D, int64_t t0,
                               int64_t nt, const int64_t* n_row, int64_t n_max, int64_t n_pad, float scale,
                               std::vector<uint16_t>& qp, std::vector<float>& sc, std::vector<uint16_t>& pbuf,
                               std::vector<uint16_t>& vlast, float* lsum, float* rmax, std::vector<float>& acc) {
  const int64_t R = nt * G, groups = (R + AMX_ROWS - 1) / AMX_ROWS, R16 = groups * AMX_ROWS, DP = D / 2;
  // Row strides of the scores and weights: n_pad plus one cache line, so a tile's 16 rows do not
  // all fall in one L1 set (n_pad is often a power of two).
  const int64_t ss = n_pad + LANES, ps = n_pad + 32;
  qp.assign(R16 * D, 0);
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t g = 0; g < G; ++g)
      std::memcpy(qp.data() + (i * G + g) * D, q + (t0 + i) * q_t + (h * G + g) * q_h, D * sizeof(uint16_t));
  sc.resize(R16 * ss);
  // Pass 1: per 16-position block and group of 16 rows, C = sum over d-chunks of A (queries,
  // 16 rows x kp pairs) times B (the block's keys, kp d-pairs x 16 positions x 2), stored
  // straight into the scores (scaled in pass 2).
  const int64_t chunks = (DP + 15) / 16;  // the last one 8 or 16 pairs
  for (int64_t j0 = 0; j0 < n_max; j0 += LANES) {
    const uint16_t* kp = key_pairs(kc, k_st, row_bt, page, h, j0);
    const int64_t r_end = rows_seeing(n_row, nt, G, j0);
    for (int64_t g0 = 0; g0 < r_end; g0 += AMX_ROWS) {
      _tile_zero(0);
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* a = qp.data() + g0 * D + c * 32;
        const uint16_t* b = kp + c * 16 * 2 * page;
        if (DP - 16 * c >= 16) {
          _tile_loadd(4, a, D * 2);
          _tile_loadd(5, b, page * 4);
          _tile_dpbf16ps(0, 4, 5);
        } else {
          _tile_loadd(6, a, D * 2);
          _tile_loadd(7, b, page * 4);
          _tile_dpbf16ps(0, 6, 7);
        }
      }
      _tile_stored(0, sc.data() + g0 * ss + j0, ss * 4);
    }
  }
  // Pass 2: scale, softmax weights (fp32) and their sum; the weights rounded to bf16, +0 from
  // the row's position to the end of its row (the blocks its group reads past it).
  pbuf.resize(R16 * ps);  // rows past R: any bits (a tile row changes only its own outputs)
  for (int64_t r = 0; r < R; ++r) {
    uint16_t* pb = pbuf.data() + r * ps;
    const int64_t n = n_row[r / G];
    lsum[r] = softmax_weights_bf16<true>(sc.data() + r * ss, n, scale, rmax + r, pb);
    std::memset(pb + n, 0, (n_pad - n) * sizeof(uint16_t));
  }
  // The last block's slots past n_max from a zeroed copy ([8 pairs][D][2]).
  const int64_t jl = n_max / LANES * LANES;
  if (jl < n_max) {
    vlast.assign(LANES * D, 0);
    const uint16_t* src =
        reinterpret_cast<const uint16_t*>(vc + row_bt[jl / page] * v_st[0] + h * v_st[1]) + (jl % page) * D;
    for (int64_t j = 0; j < n_max - jl; ++j)
      for (int64_t d = 0; d < D; ++d) vlast[(j / 2) * 2 * D + 2 * d + (j & 1)] = src[(j / 2) * 2 * D + 2 * d + (j & 1)];
  }
  // Pass 3: per group of 16 rows and 64 output dims, four C tiles accumulate A (weights, 16
  // rows x 8 position pairs) times B (the block's values, 8 pairs x 16 dims x 2).
  acc.resize(R16 * D);
  for (int64_t g0 = 0; g0 < R; g0 += AMX_ROWS) {
    const int64_t g_n = n_row[(std::min(g0 + AMX_ROWS, R) - 1) / G];  // the group's last row sees the most
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t nc = std::min<int64_t>(4, (D - d0) / 16);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t j0 = 0; j0 < g_n; j0 += LANES) {
        const uint16_t* vp =
            j0 == jl ? vlast.data()
                     : reinterpret_cast<const uint16_t*>(vc + row_bt[j0 / page] * v_st[0] + h * v_st[1]) + (j0 % page) * D;
        _tile_loadd(6, pbuf.data() + g0 * ps + j0, ps * 2);
#define TITAN_AMX_PV(t)                                    \
  if (t < nc) {                                            \
    _tile_loadd(7, vp + (d0 + 16 * t) * 2, D * 4);         \
    _tile_dpbf16ps(t, 6, 7);                               \
  }
        TITAN_AMX_PV(0) TITAN_AMX_PV(1) TITAN_AMX_PV(2) TITAN_AMX_PV(3)
#undef TITAN_AMX_PV
      }
      float* o = acc.data() + g0 * D + d0;
      if (nc > 0) _tile_stored(0, o, D * 4);
      if (nc > 1) _tile_stored(1, o + 16, D * 4);
      if (nc > 2) _tile_stored(2, o + 32, D * 4);
      if (nc > 3) _tile_stored(3, o + 48, D * 4);
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
                    TQ* out, bool dots, bool amx, float* lse) {
  const int64_t G = H / Hkv;
#ifdef TITAN_RL_ATTN_DPBF16
  constexpr bool BF16_BOTH = std::is_same_v<TQ, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  constexpr bool BF16_BOTH = false;
  (void)dots;
#endif
#ifndef TITAN_RL_ATTN_AMX
  (void)amx;
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
#ifdef TITAN_RL_ATTN_AMX
    std::vector<uint16_t> qp16, vlast;
    std::vector<float> acc16;
    if (BF16_BOTH && amx) amx_configure();
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
          const float* accp = acc.data();
#ifdef TITAN_RL_ATTN_AMX
          if (amx) {
            attention_tile_amx(q, q_t, q_h, kc, vc, k_st, v_st, row_bt, page, h, G, D, t0, nt, n_row, n_max, n_pad,
                               scale, qp16, sc, pbuf, vlast, lsum.data(), rmax.data(), acc16);
            accp = acc16.data();
          } else
#endif
          attention_tile_dpbf16(q, q_t, q_h, kc, vc, k_st, v_st, row_bt, page, h, G, D, t0, nt, n_row, n_max, n_pad,
                                scale, qp.data(), sc.data(), pbuf, lsum.data(), rmax.data(), acc.data());
          for (int64_t i = 0; i < nt; ++i)
            for (int64_t g = 0; g < G; ++g) {
              const int64_t r = i * G + g;
              TQ* o = out + (t0 + i) * H * D + (h * G + g) * D;
              const float l = lsum[r];
              for (int64_t d = 0; d < D; ++d) o[d] = from_f<TQ>(accp[r * D + d] / l);
              if (lse) lse[(t0 + i) * H + h * G + g] = rmax[r] + std::log(l);
            }
          continue;
        }
      }
#endif
      // Pass 1: scores, LANES positions at a time from the transposed keys.
      for (int64_t j0 = 0; j0 < n_max; j0 += LANES) {
        const C* kt = kc + row_bt[j0 / page] * k_st[0] + h * k_st[1] + (j0 % page);
        const int64_t r_end = rows_seeing(n_row, nt, G, j0);
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
#ifdef TITAN_RL_ATTN_AMX
    if (BF16_BOTH && amx) _tile_release();  // the thread's tile state back to the OS's init state
#endif
  });
}

// q [T, H, D]; k_cache [pages, Hkv, D, page] (keys transposed, slots contiguous);
// v_cache [pages, Hkv, page, D] (rows contiguous); query_start_loc [S+1]; seq_lens [S]
// (KV length including this call's tokens); block_table [S, max_pages]. page must be a
// multiple of LANES. Returns [T, H, D] in q's dtype.
std::tuple<at::Tensor, at::Tensor> attention_core(const at::Tensor& q_in, const at::Tensor& k_cache,
                                                 const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                                                 const at::Tensor& seq_lens, const at::Tensor& block_table,
                                                 double scale, c10::string_view form, bool want_lse) {
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
  // the form the caller chose (attention/torch_impl.py: ATTN_FORM, once per platform): fp32, or
  // one of the bf16 forms, whose cache is in the pair layout (dpbf16; amx, the same layout on tiles)
  TORCH_CHECK(form == "fp32" || form == "dpbf16" || form == "amx", "paged_attention: form '", form,
              "'; allowed: fp32, dpbf16, amx");
  const bool dots = form != "fp32", amx = form == "amx";
  TORCH_CHECK(!dots || (dpbf16_form_available() && D <= 256 && q.scalar_type() == at::kBFloat16 &&
                        k_cache.scalar_type() == at::kBFloat16 && k_cache.stride(2) == page && v_cache.stride(2) == D),
              "paged_attention: the bf16 form takes bf16 queries and a bf16 cache in the pair layout, head_dim <= 256, "
              "on a CPU with AVX512-BF16");
  TORCH_CHECK(!amx || (dots && amx_form_available()), "paged_attention: the amx form is the bf16 form's layout on a CPU "
              "with AMX-BF16 (and the OS's leave to use it)");
#define TITAN_ATTN(TQ, TC)                                                                                         \
  attention_rows<TQ, TC>(q.data_ptr<TQ>(), q.stride(0), q.stride(1), k_cache.data_ptr<TC>(),                      \
                         v_cache.data_ptr<TC>(), kst, vst, qsl.data_ptr<int64_t>(), sl.data_ptr<int64_t>(),          \
                         bt.data_ptr<int64_t>(), bt.size(1), page, S, H, Hkv, D, sc, out.data_ptr<TQ>(), dots, amx, \
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
                           const at::Tensor& block_table, double scale, c10::string_view form) {
  return std::get<0>(attention_core(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, form, false));
}

std::tuple<at::Tensor, at::Tensor> paged_attention_lse(const at::Tensor& q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                                                       const at::Tensor& seq_lens, const at::Tensor& block_table,
                                                       double scale, c10::string_view form) {
  return attention_core(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, form, true);
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_table, float scale, str form=\"fp32\") -> Tensor",
        &titan_rl::paged_attention);
  m.def("paged_attention_lse(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_table, float scale, str form=\"fp32\") -> (Tensor, Tensor)",
        &titan_rl::paged_attention_lse);
  m.def("paged_attention_dpbf16_available() -> bool", &titan_rl::dpbf16_form_available);
  m.def("paged_attention_amx_available() -> bool", &titan_rl::amx_form_available);
}
