// Row-wise ops on the decode hot path, one call each instead of a chain of small torch
// ops: RMSNorm, RoPE (q and k in one call) and the KV-cache write. The same IEEE
// operations for every row whatever the row count (common.h).
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace titan_rl {
namespace {

template <typename T>
inline T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// out = w * round_x(x * 1/sqrt(mean(x^2) + eps)): HF Qwen3 semantics (normalise in fp32,
// round to x's dtype, scale, the product in the promoted dtype). mean(x^2) is LANES
// partial sums (element i into lane i mod LANES) combined by the fixed tree, then / N.
template <typename TX, typename TW, typename TO>
void rms_rows(const TX* x, const TW* w, TO* o, int64_t rows, int64_t N, float eps) {
  at::parallel_for(0, rows, 64, [=](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const TX* xr = x + r * N;
      TO* orow = o + r * N;
      float lanes[LANES];
      for (int l = 0; l < LANES; ++l) lanes[l] = 0.0f;
      const int64_t full = N - N % LANES;
      for (int64_t i0 = 0; i0 < full; i0 += LANES)
        for (int l = 0; l < LANES; ++l) {
          const float v = to_f(xr[i0 + l]);
          lanes[l] = lanes[l] + v * v;
        }
      for (int64_t i = full; i < N; ++i) {
        const float v = to_f(xr[i]);
        lanes[i - full] = lanes[i - full] + v * v;
      }
      const float inv = 1.0f / std::sqrt(lane_tree(lanes) / static_cast<float>(N) + eps);
      for (int64_t i = 0; i < N; ++i) {
        const float y = to_f(from_f<TX>(to_f(xr[i]) * inv));
        orow[i] = from_f<TO>(to_f(w[i]) * y);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t N = x.size(-1);
  TORCH_CHECK(w.numel() == N, "rms_norm: weight has ", w.numel(), " elements, rows ", N);
  const bool xb = x.scalar_type() == at::kBFloat16, wb = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK((xb || x.scalar_type() == at::kFloat) && (wb || w.scalar_type() == at::kFloat),
              "rms_norm: float32 or bfloat16 only");
  const bool ob = xb && wb;
  at::Tensor o = at::empty(x.sizes(), x.options().dtype(ob ? at::kBFloat16 : at::kFloat));
  const int64_t rows = N ? x.numel() / N : 0;
  const float e = static_cast<float>(eps);
  using B = c10::BFloat16;
  if (xb && wb) rms_rows<B, B, B>(ptr<B>(x), ptr<B>(w), ptr<B>(o), rows, N, e);
  else if (xb) rms_rows<B, float, float>(ptr<B>(x), ptr<float>(w), ptr<float>(o), rows, N, e);
  else if (wb) rms_rows<float, B, float>(ptr<float>(x), ptr<B>(w), ptr<float>(o), rows, N, e);
  else rms_rows<float, float, float>(ptr<float>(x), ptr<float>(w), ptr<float>(o), rows, N, e);
  return o;
}

// The gradient of rms_norm (the function above, its rounding of the normalised row taken
// as the identity, as autograd takes it), in fp32:
//   gx_j = inv * gn_j - x_j * ((inv * inv * inv) * (dot / N)),  gn_j = grad_j * w_j,
//   dot = sum_j gn_j * x_j (LANES partial sums and the fixed tree, as the forward's sum
//   of squares), inv the forward's, recomputed by the same operations;
//   gw_parts[h][j] = sum over the rows r of head h (r mod H == h) of grad_rj * y_rj,
//   y the forward's rounded normalised row; the k-th row of a head goes into partial sum
//   k mod LANES, the partials added by the fixed tree.
// A row's gx depends on that row alone, a column's partial on its column alone: threads
// split rows (gx) and column blocks (gw), so neither depends on the thread count.
template <typename TG, typename TX, typename TW>
void rms_backward_rows(const TG* g, const TX* x, const TW* w, TX* gx, float* gw, float* inv_rows, int64_t rows,
                       int64_t N, int64_t H, float eps) {
  at::parallel_for(0, rows, 64, [=](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const TX* xr = x + r * N;
      const TG* gr = g + r * N;
      float sq[LANES], dt[LANES];
      for (int l = 0; l < LANES; ++l) sq[l] = dt[l] = 0.0f;
      const int64_t full = N - N % LANES;
      for (int64_t i0 = 0; i0 < full; i0 += LANES)
        for (int l = 0; l < LANES; ++l) {
          const float v = to_f(xr[i0 + l]);
          sq[l] = sq[l] + v * v;
          dt[l] = dt[l] + (to_f(gr[i0 + l]) * to_f(w[i0 + l])) * v;
        }
      for (int64_t i = full; i < N; ++i) {
        const float v = to_f(xr[i]);
        sq[i - full] = sq[i - full] + v * v;
        dt[i - full] = dt[i - full] + (to_f(gr[i]) * to_f(w[i])) * v;
      }
      const float inv = 1.0f / std::sqrt(lane_tree(sq) / static_cast<float>(N) + eps);
      const float c = (inv * inv) * inv * (lane_tree(dt) / static_cast<float>(N));
      inv_rows[r] = inv;
      TX* out = gx + r * N;
      for (int64_t i = 0; i < N; ++i) out[i] = from_f<TX>(inv * (to_f(gr[i]) * to_f(w[i])) - to_f(xr[i]) * c);
    }
  });
  constexpr int64_t CB = 64;  // columns per block
  const int64_t per_head = H ? rows / H : 0;
  const int64_t blocks = (N + CB - 1) / CB;
  at::parallel_for(0, H * blocks, 1, [=](int64_t b, int64_t e) {
    float acc[LANES][CB];
    for (int64_t hb = b; hb < e; ++hb) {
      const int64_t h = hb / blocks, j0 = (hb % blocks) * CB, nj = std::min(CB, N - j0);
      for (int l = 0; l < LANES; ++l)
        for (int64_t j = 0; j < CB; ++j) acc[l][j] = 0.0f;
      for (int64_t k = 0; k < per_head; ++k) {
        const int64_t r = k * H + h;
        const TX* xr = x + r * N + j0;
        const TG* gr = g + r * N + j0;
        const float inv = inv_rows[r];
        float* a = acc[k % LANES];
        for (int64_t j = 0; j < nj; ++j) a[j] = a[j] + to_f(gr[j]) * to_f(from_f<TX>(to_f(xr[j]) * inv));
      }
      for (int64_t j = 0; j < nj; ++j) {
        float t[LANES];
        for (int l = 0; l < LANES; ++l) t[l] = acc[l][j];
        gw[h * N + j0 + j] = lane_tree(t);
      }
    }
  });
}

// grad, x [..., N] (rows = numel / N, grouped as (token, head) with H heads per token),
// weight [N]. Returns gx (x's dtype, x's shape) and the weight gradient's per-head
// partials [H, N] in fp32 (H = 1: the weight gradient itself, in fp32).
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_in, const at::Tensor& x_in,
                                                     const at::Tensor& w_in, double eps, int64_t heads) {
  const at::Tensor g = grad_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t N = x.size(-1);
  TORCH_CHECK(w.numel() == N && g.sizes() == x.sizes(), "rms_norm_backward: weight [N] and grad of x's shape expected");
  const int64_t rows = N ? x.numel() / N : 0;
  TORCH_CHECK(heads >= 1 && rows % heads == 0, "rms_norm_backward: ", rows, " rows are not whole tokens of ", heads,
              " heads");
  const bool gb = g.scalar_type() == at::kBFloat16, xb = x.scalar_type() == at::kBFloat16,
             wb = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK((gb || g.scalar_type() == at::kFloat) && (xb || x.scalar_type() == at::kFloat) &&
                  (wb || w.scalar_type() == at::kFloat),
              "rms_norm_backward: float32 or bfloat16 only");
  at::Tensor gx = at::empty(x.sizes(), x.options());
  at::Tensor gw = at::empty({heads, N}, x.options().dtype(at::kFloat));
  at::Tensor inv = at::empty({rows}, x.options().dtype(at::kFloat));
  const float e = static_cast<float>(eps);
  using B = c10::BFloat16;
  float *gwp = ptr<float>(gw), *ip = ptr<float>(inv);
#define TITAN_RMS_BWD(TG, TX, TW) \
  rms_backward_rows<TG, TX, TW>(ptr<TG>(g), ptr<TX>(x), ptr<TW>(w), ptr<TX>(gx), gwp, ip, rows, N, heads, e)
  if (gb && xb && wb) TITAN_RMS_BWD(B, B, B);
  else if (gb && xb) TITAN_RMS_BWD(B, B, float);
  else if (gb && wb) TITAN_RMS_BWD(B, float, B);
  else if (gb) TITAN_RMS_BWD(B, float, float);
  else if (xb && wb) TITAN_RMS_BWD(float, B, B);
  else if (xb) TITAN_RMS_BWD(float, B, float);
  else if (wb) TITAN_RMS_BWD(float, float, B);
  else TITAN_RMS_BWD(float, float, float);
#undef TITAN_RMS_BWD
  return {gx, gw};
}

// Rotate-half RoPE, HF semantics in x's dtype: out = round(round(x * c) + round(rot(x) * s)),
// rot(x) = [-x2, x1], c/s the table rows (already in x's dtype) of each token's position.
template <typename T>
void rope_rows(const T* x, T* o, const T* cos, const T* sin, const int64_t* pos, int64_t T_, int64_t heads,
               int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, T_, 16, [=](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* c = cos + pos[t] * d;
      const T* s = sin + pos[t] * d;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (t * heads + h) * d;
        T* orow = o + (t * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_f(from_f<T>(to_f(xr[i]) * to_f(c[i])));
          const float bb = to_f(from_f<T>(-to_f(xr[i + half]) * to_f(s[i])));
          orow[i] = from_f<T>(a + bb);
        }
        for (int64_t i = half; i < d; ++i) {
          const float a = to_f(from_f<T>(to_f(xr[i]) * to_f(c[i])));
          const float bb = to_f(from_f<T>(to_f(xr[i - half]) * to_f(s[i])));
          orow[i] = from_f<T>(a + bb);
        }
      }
    }
  });
}

// x [T, heads, d]; cos/sin tables [P, d] in x's dtype; positions [T]. Returns [T, heads, d].
at::Tensor rope(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  const at::Tensor x = x_in.contiguous(), pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(x.dim() == 3 && cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type(),
              "rope: x [T, heads, d] and contiguous tables in x's dtype expected");
  at::Tensor o = at::empty(x.sizes(), x.options());
  const int64_t T_ = x.size(0), heads = x.size(1), d = x.size(2);
  if (x.scalar_type() == at::kFloat)
    rope_rows<float>(ptr<float>(x), ptr<float>(o), ptr<float>(cos), ptr<float>(sin), ptr<int64_t>(pos), T_, heads, d);
  else if (x.scalar_type() == at::kBFloat16)
    rope_rows<c10::BFloat16>(ptr<c10::BFloat16>(x), ptr<c10::BFloat16>(o), ptr<c10::BFloat16>(cos),
                             ptr<c10::BFloat16>(sin), ptr<int64_t>(pos), T_, heads, d);
  else
    TORCH_CHECK(false, "rope: float32 or bfloat16 only");
  return o;
}

// Store key/value [n, Hkv, D] at cache slots [n] (page * page_size + offset, >= 0) of
// cache [pages, Hkv, 2, page, D], in the layout paged_attention reads. Per page and head:
//   plain (the fp32 form): keys transposed [D, page], values as rows [page, D];
//   pairs (the bf16 form): keys [D/2, page, 2] (d-pairs of a position adjacent), values
//     [page/2, D, 2] (position pairs of a d adjacent): each 64-byte line then holds what
//     one vdpbf16ps reads.
template <typename C, typename S>
void write_rows(C* cache, const S* key, const S* value, const int64_t* slots, int64_t n, int64_t hkv, int64_t page,
                int64_t D, bool pairs) {
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;  // vLLM's padding tokens (slot -1) are not stored
    const int64_t p = slots[t] / page, off = slots[t] % page;
    for (int64_t h = 0; h < hkv; ++h) {
      C* base = cache + ((p * hkv + h) * 2) * page * D;
      const S* k = key + (t * hkv + h) * D;
      const S* v = value + (t * hkv + h) * D;
      C* vbase = base + page * D;
      if (pairs) {
        for (int64_t d = 0; d < D; ++d) base[((d / 2) * page + off) * 2 + (d & 1)] = from_f<C>(to_f(k[d]));
        for (int64_t d = 0; d < D; ++d) vbase[((off / 2) * D + d) * 2 + (off & 1)] = from_f<C>(to_f(v[d]));
      } else {
        for (int64_t d = 0; d < D; ++d) base[d * page + off] = from_f<C>(to_f(k[d]));
        for (int64_t d = 0; d < D; ++d) vbase[off * D + d] = from_f<C>(to_f(v[d]));
      }
    }
  }
}

void kv_cache_write(at::Tensor& cache, const at::Tensor& key_in, const at::Tensor& value_in,
                    const at::Tensor& slots_in, bool pairs) {
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous(), "kv_cache_write: cache [pages, Hkv, 2, page, D], contiguous");
  const at::Tensor key = key_in.contiguous(), value = value_in.contiguous(), slots = slots_in.to(at::kLong).contiguous();
  const int64_t hkv = cache.size(1), page = cache.size(3), D = cache.size(4), n = slots.numel();
  TORCH_CHECK(key.numel() == n * hkv * D && value.numel() == n * hkv * D, "kv_cache_write: key/value shape");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "kv_cache_write: key/value dtypes differ");
  using B = c10::BFloat16;
  const bool cb = cache.scalar_type() == at::kBFloat16, sb = key.scalar_type() == at::kBFloat16;
  TORCH_CHECK((cb || cache.scalar_type() == at::kFloat) && (sb || key.scalar_type() == at::kFloat),
              "kv_cache_write: float32 or bfloat16 only");
  TORCH_CHECK(!pairs || (cb && D % 2 == 0 && page % 2 == 0), "kv_cache_write: the pair layout is for bf16 caches");
  const int64_t* sl = ptr<int64_t>(slots);
  if (cb && sb) write_rows<B, B>(ptr<B>(cache), ptr<B>(key), ptr<B>(value), sl, n, hkv, page, D, pairs);
  else if (cb) write_rows<B, float>(ptr<B>(cache), ptr<float>(key), ptr<float>(value), sl, n, hkv, page, D, pairs);
  else if (sb) write_rows<float, B>(ptr<float>(cache), ptr<B>(key), ptr<B>(value), sl, n, hkv, page, D, false);
  else write_rows<float, float>(ptr<float>(cache), ptr<float>(key), ptr<float>(value), sl, n, hkv, page, D, false);
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &titan_rl::rms_norm);
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps, int heads) -> (Tensor, Tensor)",
        &titan_rl::rms_norm_backward);
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor positions) -> Tensor", &titan_rl::rope);
  m.def("kv_cache_write(Tensor(a!) cache, Tensor key, Tensor value, Tensor slots, bool pairs=False) -> ()",
        &titan_rl::kv_cache_write);
}
