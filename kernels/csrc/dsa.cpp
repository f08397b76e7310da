// DeepSeek sparse attention (GLM-5 / DeepSeek-V3.2) over a paged latent cache: the lightning
// indexer's scores with a fixed top-k, attention over the selected keys only, and the
// indexer key's LayerNorm. One fixed reduction order per row (common.h's rules).
//
// The cache is a [pages, page, W] tensor of token rows (the engine's vLLM cache, the
// trainer's dense [B, L, W] latents with one page per sequence); the row of position p of
// sequence s is cache[block_table[s, p / page], p % page]. A query row r belongs to sequence
// row_seq[r] at absolute position row_pos[r] and reads that sequence's rows 0..row_pos[r]
// only. Nothing a row computes depends on which other rows share the call, how they are
// grouped into work items, or the thread count:
//
// indexer_topk: for key position j <= pos,
//     I_j = sum over h = 0..Hi-1 in order of w_h * relu(((A0 + A1) + (A2 + A3)) * scale),
//     A_c the fma chain over d = c, c+4, ... of q_hd k_jd (fp32; fma(w_h, ., acc) from +0);
//   then the min(topk, pos + 1) positions of the largest I_j, ties to the LOWEST position
//   (a strict total order on (score, position): any selection algorithm picks the same
//   set), returned ascending and padded with -1. Scores are compared as order-preserving
//   integers: -0 equals +0, NaN is below every number.
// sparse_mla_attention: over the row's selected positions j (ascending), keys = the first
//   Dq channels of each cache row, values = the first dv:
//     s_j = ((A0 + A1) + (A2 + A3)) * scale; m = max s_j (in order); p_j = exp_f(s_j - m);
//     l = sum p_j in LANES lanes (slot j mod LANES) + tree; acc = fma(p_j, v_j, acc), j in
//     order; out = acc / l, rounded once to q's dtype.
// Key blocks of LANES positions are widened and transposed once per work item into a local
// [D, LANES] buffer, so LANES scores are independent lanes of one vector FMA per d: each
// lane's operations are those of the scalar loop above.
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace titan_rl {
namespace {

constexpr int64_t QTILE_IDX = 8;  // query rows of one sequence sharing each widened key block

template <typename T>
inline const T* cptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }

// The cache row of (sequence row in the block table, position p).
struct Paged {
  const char* base;
  int64_t s_page, s_row, elt, page;  // strides in bytes
  const int64_t* bt;
  int64_t bt_s;
  inline const char* row(int64_t seq, int64_t p) const {
    return base + bt[seq * bt_s + p / page] * s_page + (p % page) * s_row;
  }
};

// Every position a row reads must lie in its block-table row and on a page of the cache (a
// wrong replayed set or row must fail here, not read outside the cache).
void check_reads(const at::Tensor& cache, const at::Tensor& bt, const int64_t* row_seq, const int64_t* pos,
                 int64_t T, int64_t K) {
  const int64_t page = cache.size(1), n_pages = cache.size(0), S = bt.size(0), bt_s = bt.size(1);
  const int64_t* b = bt.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = row_seq[t];
    TORCH_CHECK(s >= 0 && s < S, "dsa: row ", t, " names sequence ", s, " of ", S);
    for (int64_t j = 0; j < K; ++j) {
      const int64_t p = pos[t * K + j];
      if (p < 0) continue;
      TORCH_CHECK(p / page < bt_s, "dsa: row ", t, " reads position ", p, " past its block table (", bt_s, " pages of ",
                  page, ")");
      const int64_t pg = b[s * bt_s + p / page];
      TORCH_CHECK(pg >= 0 && pg < n_pages, "dsa: row ", t, " reads position ", p, " on page ", pg, " of ", n_pages);
    }
  }
}

Paged paged_of(const at::Tensor& cache, const at::Tensor& bt) {
  TORCH_CHECK(cache.dim() == 3 && cache.stride(2) == 1, "dsa: cache [pages, page, W] with contiguous rows");
  const int64_t e = cache.element_size();
  return Paged{reinterpret_cast<const char*>(cache.data_ptr()), cache.stride(0) * e, cache.stride(1) * e, e,
               cache.size(1), bt.data_ptr<int64_t>(), bt.size(1)};
}

template <typename C>
inline void widen_block(const Paged& pg, int64_t seq, const int64_t* pos, int64_t n, int64_t off, int64_t D,
                        float* kblk) {
  // kblk[d * LANES + l] = channel off + d of position pos[l] (l < n); other lanes 0
  for (int64_t l = 0; l < LANES; ++l) {
    if (l < n) {
      const C* r = reinterpret_cast<const C*>(pg.row(seq, pos[l])) + off;
      for (int64_t d = 0; d < D; ++d) kblk[d * LANES + l] = to_f(r[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) kblk[d * LANES + l] = 0.0f;
    }
  }
}

// LANES dot products of one query vector with a transposed key block: four chains (d mod 4)
// then (a0 + a1) + (a2 + a3).
inline void block_dots(const float* __restrict q, const float* __restrict kblk, int64_t D, float* __restrict out) {
  float a[4][LANES];
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < LANES; ++l) a[c][l] = 0.0f;
  int64_t d = 0;
  for (; d + 4 <= D; d += 4)
    for (int c = 0; c < 4; ++c) {
      const float qd = q[d + c];
      const float* k = kblk + (d + c) * LANES;
      for (int l = 0; l < LANES; ++l) a[c][l] = __builtin_fmaf(qd, k[l], a[c][l]);
    }
  for (int c = 0; d + c < D; ++c) {
    const float qd = q[d + c];
    const float* k = kblk + (d + c) * LANES;
    for (int l = 0; l < LANES; ++l) a[c][l] = __builtin_fmaf(qd, k[l], a[c][l]);
  }
  for (int l = 0; l < LANES; ++l) out[l] = (a[0][l] + a[1][l]) + (a[2][l] + a[3][l]);
}

// An order-preserving integer image of a score: larger score, larger key; -0 == +0; NaN lowest.
inline uint32_t order_key(float x) {
  if (x != x) return 0u;
  if (x == 0.0f) x = 0.0f;
  const uint32_t b = f_to_bits(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The k positions of the largest scores, ties to the lowest position, ascending, into out.
void select_topk(const float* sc, int64_t n, int64_t k, std::vector<int64_t>& idx, std::vector<uint32_t>& key,
                 int64_t* out) {
  if (n <= k) {
    for (int64_t j = 0; j < n; ++j) out[j] = j;
    for (int64_t j = n; j < k; ++j) out[j] = -1;
    return;
  }
  idx.resize(n);
  key.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    idx[j] = j;
    key[j] = order_key(sc[j]);
  }
  const uint32_t* kk = key.data();
  auto before = [kk](int64_t a, int64_t b) { return kk[a] > kk[b] || (kk[a] == kk[b] && a < b); };
  std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), before);
  std::sort(idx.begin(), idx.begin() + k);
  for (int64_t j = 0; j < k; ++j) out[j] = idx[j];
}

// Work items: up to QTILE_IDX consecutive rows of one sequence.
std::vector<int64_t> seq_tiles(const int64_t* row_seq, int64_t T, int64_t tile) {
  std::vector<int64_t> starts;
  for (int64_t r = 0; r < T;) {
    starts.push_back(r);
    int64_t e = r + 1;
    while (e < T && e - r < tile && row_seq[e] == row_seq[r]) ++e;
    r = e;
  }
  starts.push_back(T);
  return starts;
}

template <typename TQ, typename C>
void indexer_rows(const TQ* q, const float* w, const Paged& pg, int64_t key_off, const int64_t* row_seq,
                  const int64_t* row_pos, int64_t T, int64_t H, int64_t D, float scale, int64_t topk, int64_t* out) {
  const std::vector<int64_t> starts = seq_tiles(row_seq, T, QTILE_IDX);
  const int64_t n_tiles = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, n_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(QTILE_IDX * H * D), kblk(D * LANES), sc;
    std::vector<int64_t> idx;
    std::vector<uint32_t> key;
    int64_t pos[LANES];
    float dots[LANES];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t r0 = starts[tile], nt = starts[tile + 1] - r0, seq = row_seq[r0];
      int64_t n_max = 0;
      for (int64_t i = 0; i < nt; ++i) n_max = std::max(n_max, row_pos[r0 + i] + 1);
      const int64_t n_pad = (n_max + LANES - 1) / LANES * LANES;
      sc.assign(nt * n_pad, 0.0f);
      for (int64_t i = 0; i < nt * H * D; ++i) qf[i] = to_f(q[r0 * H * D + i]);
      for (int64_t j0 = 0; j0 < n_max; j0 += LANES) {
        const int64_t n = std::min<int64_t>(LANES, n_max - j0);
        for (int64_t l = 0; l < n; ++l) pos[l] = j0 + l;
        widen_block<C>(pg, seq, pos, n, key_off, D, kblk.data());
        for (int64_t i = 0; i < nt; ++i) {
          if (row_pos[r0 + i] < j0) continue;
          float acc[LANES];
          for (int l = 0; l < LANES; ++l) acc[l] = 0.0f;
          for (int64_t h = 0; h < H; ++h) {
            block_dots(qf.data() + (i * H + h) * D, kblk.data(), D, dots);
            const float wh = w[(r0 + i) * H + h];
            for (int l = 0; l < LANES; ++l) {
              const float s = dots[l] * scale;
              acc[l] = __builtin_fmaf(wh, s > 0.0f ? s : 0.0f, acc[l]);
            }
          }
          for (int l = 0; l < LANES; ++l) sc[i * n_pad + j0 + l] = acc[l];
        }
      }
      for (int64_t i = 0; i < nt; ++i)
        select_topk(sc.data() + i * n_pad, row_pos[r0 + i] + 1, topk, idx, key, out + (r0 + i) * topk);
    }
  });
}

// q [T, H, D] (float32 / bfloat16); weights [T, H] float32; cache [pages, page, W]; the
// indexer key of a position is its row's channels key_off .. key_off + D. Returns int64 [T, topk].
at::Tensor indexer_topk(const at::Tensor& q_in, const at::Tensor& w_in, const at::Tensor& cache,
                        const at::Tensor& block_table, const at::Tensor& row_seq_in, const at::Tensor& row_pos_in,
                        int64_t key_off, double scale, int64_t topk) {
  TORCH_CHECK(q_in.dim() == 3 && w_in.dim() == 2, "indexer_topk: q [T, H, D], weights [T, H]");
  const at::Tensor q = q_in.contiguous(), w = w_in.to(at::kFloat).contiguous();
  const at::Tensor bt = block_table.to(at::kLong).contiguous();
  const at::Tensor row_seq = row_seq_in.to(at::kLong).contiguous(), row_pos = row_pos_in.to(at::kLong).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(w.size(0) == T && w.size(1) == H, "indexer_topk: weights must be [T, H]");
  TORCH_CHECK(row_seq.numel() == T && row_pos.numel() == T, "indexer_topk: row_seq / row_pos must have T entries");
  TORCH_CHECK(topk >= 1, "indexer_topk: topk must be >= 1");
  TORCH_CHECK(key_off >= 0 && key_off + D <= cache.size(2), "indexer_topk: key channels past the cache row");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "indexer_topk: float32 or bfloat16");
  TORCH_CHECK(cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16,
              "indexer_topk: cache float32 or bfloat16");
  at::Tensor out = at::empty({T, topk}, q.options().dtype(at::kLong));
  if (T == 0) return out;
  const Paged pg = paged_of(cache, bt);
  // a row reads positions 0..pos: the last page it touches decides
  check_reads(cache, bt, row_seq.data_ptr<int64_t>(), row_pos.data_ptr<int64_t>(), T, 1);
  const float sc = static_cast<float>(scale);
  using B = c10::BFloat16;
  const bool qb = q.scalar_type() == at::kBFloat16, cb = cache.scalar_type() == at::kBFloat16;
  int64_t* o = out.data_ptr<int64_t>();
  const float* wp = w.data_ptr<float>();
  const int64_t *rs = row_seq.data_ptr<int64_t>(), *rp = row_pos.data_ptr<int64_t>();
  if (qb && cb) indexer_rows<B, B>(cptr<B>(q), wp, pg, key_off, rs, rp, T, H, D, sc, topk, o);
  else if (qb) indexer_rows<B, float>(cptr<B>(q), wp, pg, key_off, rs, rp, T, H, D, sc, topk, o);
  else if (cb) indexer_rows<float, B>(cptr<float>(q), wp, pg, key_off, rs, rp, T, H, D, sc, topk, o);
  else indexer_rows<float, float>(cptr<float>(q), wp, pg, key_off, rs, rp, T, H, D, sc, topk, o);
  return out;
}

template <typename TQ, typename C>
void sparse_rows(const TQ* q, const Paged& pg, const int64_t* row_seq, const int64_t* ind, int64_t K, int64_t T,
                 int64_t H, int64_t Dq, int64_t dv, float scale, TQ* out) {
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * Dq), kblk(Dq * LANES), vblk(LANES * dv), sc, acc(H * dv);
    float dots[LANES];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t* sel = ind + t * K;
      int64_t n = 0;
      while (n < K && sel[n] >= 0) ++n;
      TQ* o = out + t * H * dv;
      if (n == 0) {  // no key selected (a padding row): zeros
        for (int64_t i = 0; i < H * dv; ++i) o[i] = from_f<TQ>(0.0f);
        continue;
      }
      const int64_t seq = row_seq[t], n_pad = (n + LANES - 1) / LANES * LANES;
      sc.assign(H * n_pad, 0.0f);
      for (int64_t i = 0; i < H * Dq; ++i) qf[i] = to_f(q[t * H * Dq + i]);
      for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        const int64_t m = std::min<int64_t>(LANES, n - j0);
        widen_block<C>(pg, seq, sel + j0, m, 0, Dq, kblk.data());
        for (int64_t h = 0; h < H; ++h) {
          block_dots(qf.data() + h * Dq, kblk.data(), Dq, dots);
          for (int l = 0; l < LANES; ++l) sc[h * n_pad + j0 + l] = dots[l] * scale;
        }
      }
      float lsum[1024];
      std::vector<float> lbuf;
      float* l_of = H <= 1024 ? lsum : (lbuf.resize(H), lbuf.data());
      for (int64_t h = 0; h < H; ++h) {
        float* s = sc.data() + h * n_pad;
        float mx = s[0];
        for (int64_t j = 1; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
        for (int64_t j = 0; j < n; ++j) s[j] = exp_f(s[j] - mx);
        float lanes[LANES];
        for (int l = 0; l < LANES; ++l) lanes[l] = 0.0f;
        for (int64_t j = 0; j < n; ++j) lanes[j % LANES] = lanes[j % LANES] + s[j];
        l_of[h] = lane_tree(lanes);
      }
      for (int64_t i = 0; i < H * dv; ++i) acc[i] = 0.0f;
      for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        const int64_t m = std::min<int64_t>(LANES, n - j0);
        for (int64_t l = 0; l < m; ++l) {
          const C* r = reinterpret_cast<const C*>(pg.row(seq, sel[j0 + l]));
          for (int64_t d = 0; d < dv; ++d) vblk[l * dv + d] = to_f(r[d]);
        }
        for (int64_t h = 0; h < H; ++h) {
          float* a = acc.data() + h * dv;
          const float* p = sc.data() + h * n_pad + j0;
          for (int64_t l = 0; l < m; ++l) {
            const float pj = p[l];
            const float* v = vblk.data() + l * dv;
            for (int64_t d = 0; d < dv; ++d) a[d] = __builtin_fmaf(pj, v[d], a[d]);
          }
        }
      }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < dv; ++d) o[h * dv + d] = from_f<TQ>(acc[h * dv + d] / l_of[h]);
    }
  });
}

// q [T, H, Dq]; cache [pages, page, W] (keys: channels 0..Dq, values: 0..dv of each row);
// indices [T, K] absolute positions, ascending, -1 padded. Returns [T, H, dv] in q's dtype.
at::Tensor sparse_mla_attention(const at::Tensor& q_in, const at::Tensor& cache, const at::Tensor& block_table,
                                const at::Tensor& row_seq_in, const at::Tensor& indices_in, double scale, int64_t dv) {
  TORCH_CHECK(q_in.dim() == 3 && indices_in.dim() == 2, "sparse_mla_attention: q [T, H, Dq], indices [T, K]");
  const at::Tensor q = q_in.contiguous(), ind = indices_in.to(at::kLong).contiguous();
  const at::Tensor bt = block_table.to(at::kLong).contiguous(), row_seq = row_seq_in.to(at::kLong).contiguous();
  const int64_t T = q.size(0), H = q.size(1), Dq = q.size(2), K = ind.size(1);
  TORCH_CHECK(ind.size(0) == T && row_seq.numel() == T, "sparse_mla_attention: indices / row_seq need T rows");
  TORCH_CHECK(Dq <= cache.size(2) && dv >= 1 && dv <= cache.size(2), "sparse_mla_attention: key / value channels "
              "past the cache row");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "sparse_mla_attention: float32 or "
              "bfloat16");
  TORCH_CHECK(cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16,
              "sparse_mla_attention: cache float32 or bfloat16");
  at::Tensor out = at::empty({T, H, dv}, q.options());
  if (T == 0) return out;
  const Paged pg = paged_of(cache, bt);
  check_reads(cache, bt, row_seq.data_ptr<int64_t>(), ind.data_ptr<int64_t>(), T, K);
  const float sc = static_cast<float>(scale);
  using B = c10::BFloat16;
  const bool qb = q.scalar_type() == at::kBFloat16, cb = cache.scalar_type() == at::kBFloat16;
  const int64_t *rs = row_seq.data_ptr<int64_t>(), *ip = ind.data_ptr<int64_t>();
  if (qb && cb) sparse_rows<B, B>(cptr<B>(q), pg, rs, ip, K, T, H, Dq, dv, sc, out.data_ptr<B>());
  else if (qb) sparse_rows<B, float>(cptr<B>(q), pg, rs, ip, K, T, H, Dq, dv, sc, out.data_ptr<B>());
  else if (cb) sparse_rows<float, B>(cptr<float>(q), pg, rs, ip, K, T, H, Dq, dv, sc, out.data_ptr<float>());
  else sparse_rows<float, float>(cptr<float>(q), pg, rs, ip, K, T, H, Dq, dv, sc, out.data_ptr<float>());
  return out;
}

// LayerNorm of rows (torch.nn.LayerNorm semantics: in fp32, rounded once to x's dtype):
// mean = (sum x in LANES lanes + tree) / N; var = (sum (x - mean)^2 likewise) / N;
// y = ((x - mean) * (1 / sqrt(var + eps))) * w + b.
template <typename TX, typename TW>
void layer_norm_rows(const TX* x, const TW* w, const TW* b, TX* o, int64_t rows, int64_t N, float eps) {
  at::parallel_for(0, rows, 64, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const TX* xr = x + r * N;
      float lanes[LANES];
      for (int l = 0; l < LANES; ++l) lanes[l] = 0.0f;
      for (int64_t i = 0; i < N; ++i) lanes[i % LANES] = lanes[i % LANES] + to_f(xr[i]);
      const float mean = lane_tree(lanes) / static_cast<float>(N);
      for (int l = 0; l < LANES; ++l) lanes[l] = 0.0f;
      for (int64_t i = 0; i < N; ++i) {
        const float c = to_f(xr[i]) - mean;
        lanes[i % LANES] = lanes[i % LANES] + c * c;
      }
      const float rstd = 1.0f / std::sqrt(lane_tree(lanes) / static_cast<float>(N) + eps);
      for (int64_t i = 0; i < N; ++i)
        o[r * N + i] = from_f<TX>(((to_f(xr[i]) - mean) * rstd) * to_f(w[i]) + to_f(b[i]));
    }
  });
}

at::Tensor layer_norm(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& b_in, double eps) {
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), b = b_in.to(w_in.scalar_type()).contiguous();
  const int64_t N = x.size(-1);
  TORCH_CHECK(w.numel() == N && b.numel() == N, "layer_norm: weight / bias need ", N, " elements");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "layer_norm: float32 or bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "layer_norm: float32 or bfloat16");
  at::Tensor o = at::empty(x.sizes(), x.options());
  const int64_t rows = N ? x.numel() / N : 0;
  const float e = static_cast<float>(eps);
  using B = c10::BFloat16;
  const bool xb = x.scalar_type() == at::kBFloat16, wb = w.scalar_type() == at::kBFloat16;
  if (xb && wb) layer_norm_rows<B, B>(cptr<B>(x), cptr<B>(w), cptr<B>(b), o.data_ptr<B>(), rows, N, e);
  else if (xb) layer_norm_rows<B, float>(cptr<B>(x), cptr<float>(w), cptr<float>(b), o.data_ptr<B>(), rows, N, e);
  else if (wb) layer_norm_rows<float, B>(cptr<float>(x), cptr<B>(w), cptr<B>(b), o.data_ptr<float>(), rows, N, e);
  else layer_norm_rows<float, float>(cptr<float>(x), cptr<float>(w), cptr<float>(b), o.data_ptr<float>(), rows, N, e);
  return o;
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("indexer_topk(Tensor q, Tensor weights, Tensor cache, Tensor block_table, Tensor row_seq, Tensor row_pos, "
        "int key_off, float scale, int topk) -> Tensor",
        &titan_rl::indexer_topk);
  m.def("sparse_mla_attention(Tensor q, Tensor cache, Tensor block_table, Tensor row_seq, Tensor indices, "
        "float scale, int dv) -> Tensor",
        &titan_rl::sparse_mla_attention);
  m.def("layer_norm(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor", &titan_rl::layer_norm);
}
