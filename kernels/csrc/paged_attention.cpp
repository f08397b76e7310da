// Causal GQA attention over a paged KV cache, one fixed reduction order per row.
//
// A row = (one query token, one query head). Its output is computed from its own query,
// its sequence's keys/values at positions 0..pos (pos = its absolute position) and
// nothing else, in an order fixed by pos alone:
//   scores s_j = (q . k_j) * scale, j = 0..pos, each dot over D in LANES lanes + tree;
//   m = max_j s_j; p_j = exp_f(s_j - m);
//   l = sum_j p_j in LANES lanes (j mod LANES) + tree;  acc = sum_j p_j v_j, j ascending;
//   out = acc / l, rounded to the query dtype.
// So the trainer's dense causal forward (a dense [B, L, Hkv, D] tensor is a cache of B
// pages of L slots, page table [b]), the engine's prefill, chunked prefill, decode and
// prefix-cache hits give a row the same bits, whatever else shares the call. Keys and
// values are read in place through the page table (no gather, no layout copy). Slots
// past a row's position are never read, so uninitialised cache memory cannot leak in.
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
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

inline float dot_lanes(const float* __restrict a, const float* __restrict b, int64_t D) {
  float lanes[LANES];
  for (int l = 0; l < LANES; ++l) lanes[l] = 0.0f;
  for (int64_t d0 = 0; d0 < D; d0 += LANES)
    for (int l = 0; l < LANES; ++l) lanes[l] = lanes[l] + a[d0 + l] * b[d0 + l];
  return lane_tree(lanes);
}

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

inline void axpy(float* __restrict acc, float p, const float* __restrict v, int64_t D) {
  for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + p * v[d];
}

// Work items: (sequence, first query token, end) tiles of <= QTILE tokens, times kv heads.
// A row's arithmetic is the same whichever tile it is in: each tile member only skips
// the positions past its own.
template <typename TQ, typename C>
void attention_rows(const TQ* q, int64_t q_t, int64_t q_h, const C* kc, const C* vc, const int64_t* kv_st,
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
    std::vector<float> qf(QTILE * G * D), kbuf(D), acc(QTILE * G * D), sc, lsum(QTILE * G);
    int64_t n_row[QTILE];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % Hkv, tile = item / Hkv;
      const int64_t s = tiles[3 * tile], t0 = tiles[3 * tile + 1], t1 = tiles[3 * tile + 2];
      const int64_t nt = t1 - t0, R = nt * G;
      const int64_t first_pos = seq_lens[s] - (qsl[s + 1] - qsl[s]) + (t0 - qsl[s]);
      for (int64_t i = 0; i < nt; ++i) n_row[i] = first_pos + i + 1;
      const int64_t n_max = n_row[nt - 1];
      sc.resize(R * n_max);
      for (int64_t i = 0; i < nt; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const TQ* qr = q + (t0 + i) * q_t + (h * G + g) * q_h;
          for (int64_t d = 0; d < D; ++d) qf[(i * G + g) * D + d] = to_f(qr[d]);
        }
      const int64_t* row_bt = bt + s * bt_s;
      // Pass 1: scores s_j = (q . k_j) * scale for j < n of each row.
      for (int64_t j = 0; j < n_max; ++j) {
        const float* k = row_f32(kc + row_bt[j / page] * kv_st[0] + h * kv_st[1] + (j % page) * kv_st[2],
                                 kbuf.data(), D);
        for (int64_t i = 0; i < nt; ++i) {
          if (j >= n_row[i]) continue;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = i * G + g;
            sc[r * n_max + j] = dot_lanes(qf.data() + r * D, k, D) * scale;
          }
        }
      }
      // Pass 2: softmax weights and their sum, per row over its own n.
      for (int64_t r = 0; r < R; ++r) lsum[r] = softmax_weights(sc.data() + r * n_max, n_row[r / G]);
      // Pass 3: acc = sum_j p_j v_j, j ascending.
      for (int64_t i = 0; i < R * D; ++i) acc[i] = 0.0f;
      for (int64_t j = 0; j < n_max; ++j) {
        const float* v = row_f32(vc + row_bt[j / page] * v_st[0] + h * v_st[1] + (j % page) * v_st[2],
                                 kbuf.data(), D);
        for (int64_t i = 0; i < nt; ++i) {
          if (j >= n_row[i]) continue;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = i * G + g;
            axpy(acc.data() + r * D, sc[r * n_max + j], v, D);
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

// q [T, H, D]; k_cache, v_cache [pages, Hkv, page, D] (any strides, last dim
// contiguous); query_start_loc [S+1]; seq_lens [S] (KV length including this call's
// tokens); block_table [S, max_pages]. Returns [T, H, D] in q's dtype.
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& block_table, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_attention: bad ranks");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "paged_attention: cache rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: k/v dtypes differ");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), page = k_cache.size(2);
  TORCH_CHECK(D % LANES == 0, "paged_attention: head_dim ", D, " must be a multiple of ", LANES);
  TORCH_CHECK(H % Hkv == 0, "paged_attention: heads ", H, " not a multiple of kv heads ", Hkv);
  const at::Tensor qsl = query_start_loc.to(at::kLong).contiguous();
  const at::Tensor sl = seq_lens.to(at::kLong).contiguous();
  const at::Tensor bt = block_table.to(at::kLong).contiguous();
  const int64_t S = sl.size(0);
  at::Tensor out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t kst[3] = {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
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
