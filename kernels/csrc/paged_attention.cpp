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
// dense keys as a [B, Hkv, D, L16] copy (one page per sequence, L padded to LANES) and its
// values as a view. Keys and values are read in place through the page table. Scores of
// slots past a row's position may be computed from uninitialised memory (the last
// LANES-block) but are never used: lanes are independent, nothing mixes them in.
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace titan_rl {
namespace {

constexpr int64_t QTILE = 4;  // query tokens of one sequence sharing each key/value load

template <typename C>
inline const float* row_f32(const C* src, float* buf, int64_t D) {
  for (int64_t d = 0; d < D; ++d) buf[d] = to_f(src[d]);
  return buf;
}
template <>
inline const float* row_f32<float>(const float* src, float*, int64_t) { return src; }

// p_j = exp(s_j - max s) in place over n scores; returns sum_j p_j (j mod LANES lanes, tree).
inline float softmax_weights(float* __restrict sg, int64_t n) {
  float m = sg[0];
  for (int64_t j = 1; j < n; ++j) m = sg[j] > m ? sg[j] : m;
  for (int64_t j = 0; j < n; ++j) sg[j] = exp_f(sg[j] - m);
  float lanes[LANES];
  for (int l = 0; l < LANES; ++l) lanes[l] = 0.0f;
  const int64_t full = n - n % LANES;
  for (int64_t j0 = 0; j0 < full; j0 += LANES)
    for (int l = 0; l < LANES; ++l) lanes[l] = lanes[l] + sg[j0 + l];
  for (int64_t j = full; j < n; ++j) lanes[j - full] = lanes[j - full] + sg[j];
  return lane_tree(lanes);
}

// acc[d] = fma(p_j, v_j[d], acc[d]) for j = 0..n-1 in order (v rows of D floats): the
// accumulator stays in registers for the usual head sizes.
template <int DC>
inline void accumulate_fixed(float* __restrict acc, const float* __restrict p, const float* __restrict v, int64_t n) {
  float a[DC];
  for (int d = 0; d < DC; ++d) a[d] = acc[d];
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* vj = v + j * DC;
    for (int d = 0; d < DC; ++d) a[d] = __builtin_fmaf(pj, vj[d], a[d]);
  }
  for (int d = 0; d < DC; ++d) acc[d] = a[d];
}

inline void accumulate_rows(float* __restrict acc, const float* __restrict p, const float* __restrict v, int64_t n,
                            int64_t D) {
  switch (D) {
    case 64: return accumulate_fixed<64>(acc, p, v, n);
    case 128: return accumulate_fixed<128>(acc, p, v, n);
    case 256: return accumulate_fixed<256>(acc, p, v, n);
    default:
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) acc[d] = __builtin_fmaf(p[j], v[j * D + d], acc[d]);
  }
}

// Work items: (sequence, first query token, end) tiles of <= QTILE tokens, times kv heads.
// A row's arithmetic is the same whichever tile it is in: each tile member only skips
// the positions past its own.
template <typename TQ, typename C>
void attention_rows(const TQ* q, int64_t q_t, int64_t q_h, const C* kc, const C* vc, const int64_t* k_st,
                    const int64_t* v_st, const int64_t* qsl, const int64_t* seq_lens, const int64_t* bt,
                    int64_t bt_s, int64_t page, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale,
                    TQ* out) {
  const int64_t G = H / Hkv;
  std::vector<int64_t> tiles;  // (s, t0, t1) triples
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = qsl[s]; t < qsl[s + 1]; t += QTILE) {
      tiles.push_back(s);
      tiles.push_back(t);
      tiles.push_back(std::min(t + QTILE, qsl[s + 1]));
    }
  const int64_t n_tiles = static_cast<int64_t>(tiles.size()) / 3;
  at::parallel_for(0, n_tiles * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(QTILE * G * D), acc(QTILE * G * D), sc, lsum(QTILE * G);
    std::vector<float> kblk(D * LANES), vblk(LANES * D);
    int64_t n_row[QTILE];
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
        for (int64_t r = 0; r < r_end; ++r) {
          const float* qr = qf.data() + r * D;
          // four partial sums (d mod 4: independent dependency chains), then (a0+a1)+(a2+a3)
          float a0[LANES], a1[LANES], a2[LANES], a3[LANES];
          for (int l = 0; l < LANES; ++l) a0[l] = a1[l] = a2[l] = a3[l] = 0.0f;
          for (int64_t d = 0; d < D; d += 4) {
            const float *k0 = kb + d * kstride, *k1 = k0 + kstride, *k2 = k1 + kstride, *k3 = k2 + kstride;
            const float q0 = qr[d], q1 = qr[d + 1], q2 = qr[d + 2], q3 = qr[d + 3];
            for (int l = 0; l < LANES; ++l) {
              a0[l] = __builtin_fmaf(q0, k0[l], a0[l]);
              a1[l] = __builtin_fmaf(q1, k1[l], a1[l]);
              a2[l] = __builtin_fmaf(q2, k2[l], a2[l]);
              a3[l] = __builtin_fmaf(q3, k3[l], a3[l]);
            }
          }
          float* out_s = sc.data() + r * n_pad + j0;
          for (int l = 0; l < LANES; ++l) out_s[l] = ((a0[l] + a1[l]) + (a2[l] + a3[l])) * scale;
        }
      }
      // Pass 2: softmax weights and their sum, per row over its own n.
      for (int64_t r = 0; r < R; ++r) lsum[r] = softmax_weights(sc.data() + r * n_pad, n_row[r / G]);
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
          for (int64_t g = 0; g < G; ++g) {
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
        }
    }
  });
}

// q [T, H, D]; k_cache [pages, Hkv, D, page] (keys transposed, slots contiguous);
// v_cache [pages, Hkv, page, D] (rows contiguous); query_start_loc [S+1]; seq_lens [S]
// (KV length including this call's tokens); block_table [S, max_pages]. page must be a
// multiple of LANES. Returns [T, H, D] in q's dtype.
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& block_table, double scale) {
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
  const int64_t kst[3] = {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};  // page, head, d
  const int64_t vst[3] = {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  const float sc = static_cast<float>(scale);
#define TITAN_ATTN(TQ, TC)                                                                                         \
  attention_rows<TQ, TC>(q.data_ptr<TQ>(), q.stride(0), q.stride(1), k_cache.data_ptr<TC>(),                      \
                         v_cache.data_ptr<TC>(), kst, vst, qsl.data_ptr<int64_t>(), sl.data_ptr<int64_t>(),          \
                         bt.data_ptr<int64_t>(), bt.size(1), page, S, H, Hkv, D, sc, out.data_ptr<TQ>())
  const bool qb = q.scalar_type() == at::kBFloat16, cb = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK((qb || q.scalar_type() == at::kFloat) && (cb || k_cache.scalar_type() == at::kFloat),
              "paged_attention: float32 or bfloat16 only");
  if (qb && cb) TITAN_ATTN(c10::BFloat16, c10::BFloat16);
  else if (qb) TITAN_ATTN(c10::BFloat16, float);
  else if (cb) TITAN_ATTN(float, c10::BFloat16);
  else TITAN_ATTN(float, float);
#undef TITAN_ATTN
  return out;
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_table, float scale) -> Tensor",
        &titan_rl::paged_attention);
}
