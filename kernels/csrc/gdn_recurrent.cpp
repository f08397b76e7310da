// The gated delta rule's exact recurrent step, compiled: the same IEEE operations as the torch
// form in kernels/gdn/torch_impl.py (`_recurrent_forward_torch`, the definition this is pinned to
// with torch.equal), one (sequence, value head) pair at a time with its state in cache.
//
// Per pair, token by token, on the fp32 state S [dkp][dv] (dk zero-padded to a power of two):
//   Sd = S * a_t;  kS = tree(Sd * k_t);  u = beta_t * (v_t - kS);
//   S  = Sd + k_t * u  (a product, rounded, then a sum: no FMA);  o_t = tree(S * q_t) * scale,
// where tree(P) sums the rows of P by the torch form's halving tree: each level adds the first
// half of the rows to the second (row i + row i + h), until one row is left. Every operation is
// elementwise over the dv columns, so columns run in vectors of any width (AVX-512, AVX2, the
// scalar tail: the same roundings), and a pair's bits depend on nothing but its own inputs: not
// the other pairs, the thread count or how the stream was cut into calls (the state carries over).
//
// The torch form runs ~25 tensor ops per token over all pairs' states at once, each a pass over
// N x Hv x dkp x dv floats in memory; here a pair's state stays in L2 for all its tokens.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cache_rows.h"
#include "fp32_vec.h"

namespace titan_rl {
namespace {

using namespace fp32v;

// rows [0, n) of p summed by the halving tree into p[0]: each level adds row i + h to row i
inline void tree_rows(vec* p, int64_t n) {
  for (int64_t h = n / 2; h >= 1; h /= 2)
    for (int64_t i = 0; i < h; ++i) p[i] = vadd(p[i], p[i + h]);
}

// One pair's tokens [t0, t1) of the flat stream, from its state s0 [dk][dv] (nullptr: zeros) to s1
// [dk][dv]; the rows dk..dkp of the padded state start at +0 and are not written out. The columns
// are independent, so they run in strips of one vector, each strip's state in a contiguous buffer
// for all the tokens (8 KiB at dk 128: in L1; in place, its rows would lie dv floats apart, which
// maps them onto few L1 sets). Columns past dv in the last strip are computed from zeros and
// dropped.
void run_pair(const float* q, const float* k, const float* v, const float* a, const float* beta, int64_t t0,
              int64_t t1, int64_t Hk, int64_t Hv, int64_t dk, int64_t dkp, int64_t dv, int64_t hv, int64_t hk,
              float scale, const float* s0, float* s1, vec* Sb, vec* P, float* kt, float* qt, float* o) {
  const vec vscale = vbcast(&scale);
  for (int64_t i = dk; i < dkp; ++i) kt[i] = qt[i] = 0.0f;
  for (int64_t c0 = 0; c0 < dv; c0 += VW) {
    const int64_t w = std::min<int64_t>(VW, dv - c0);
    const bool whole = w == VW;
    float buf[VW];
    for (int64_t i = 0; i < dkp; ++i) {
      if (s0 == nullptr || i >= dk) {
        Sb[i] = vzero();
      } else if (whole) {
        Sb[i] = vload(s0 + i * dv + c0);
      } else {
        std::fill(buf, buf + VW, 0.0f);
        std::copy(s0 + i * dv + c0, s0 + i * dv + c0 + w, buf);
        Sb[i] = vload(buf);
      }
    }
    for (int64_t t = t0; t < t1; ++t) {
      std::copy(k + (t * Hk + hk) * dk, k + (t * Hk + hk + 1) * dk, kt);
      std::copy(q + (t * Hk + hk) * dk, q + (t * Hk + hk + 1) * dk, qt);
      const float at = a[t * Hv + hv], bt = beta[t * Hv + hv];
      const vec va = vbcast(&at), vb = vbcast(&bt);
      for (int64_t i = 0; i < dkp; ++i) {  // Sd = S * a (kept in S); P = Sd * k
        const vec sd = vmul(Sb[i], va);
        Sb[i] = sd;
        P[i] = vmul(sd, vbcast(kt + i));
      }
      tree_rows(P, dkp);  // S^T k
      const float* vt = v + (t * Hv + hv) * dv + c0;
      if (!whole) {
        std::fill(buf, buf + VW, 0.0f);
        std::copy(vt, vt + w, buf);
      }
      const vec u = vmul(vb, vsub(vload(whole ? vt : buf), P[0]));  // beta * (v - S^T k)
      for (int64_t i = 0; i < dkp; ++i) {  // S = Sd + k * u; P = S * q
        const vec sn = vadd(Sb[i], vmul(vbcast(kt + i), u));
        Sb[i] = sn;
        P[i] = vmul(sn, vbcast(qt + i));
      }
      tree_rows(P, dkp);  // S^T q
      float* ot = o + (t * Hv + hv) * dv + c0;
      vstore(whole ? ot : buf, vmul(P[0], vscale));
      if (!whole) std::copy(buf, buf + w, ot);
    }
    for (int64_t i = 0; i < dk; ++i) {
      vstore(whole ? s1 + i * dv + c0 : buf, Sb[i]);
      if (!whole) std::copy(buf, buf + w, s1 + i * dv + c0);
    }
  }
}

// The checks both entry points share: q, k [T, Hk, dk], v [T, Hv, dv], a (the decay, exp(g)
// already), beta [T, Hv]: fp32, contiguous; cu [N + 1] int64 rising from 0 to T. Returns N.
int64_t check_stream(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                     const at::Tensor& beta, const at::Tensor& cu) {
  for (const at::Tensor* t : {&q, &k, &v, &a, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "gdn_recurrent_f32: contiguous fp32 inputs");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "gdn_recurrent_f32: q, k [T, Hk, dk] and v [T, Hv, dv]");
  const int64_t T = q.size(0), Hk = q.size(1), Hv = v.size(1);
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, "gdn_recurrent_f32: Hv a multiple of Hk");
  TORCH_CHECK(a.dim() == 2 && a.size(0) == T && a.size(1) == Hv && beta.sizes() == a.sizes(),
              "gdn_recurrent_f32: a, beta [T, Hv]");
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1 && cu.scalar_type() == at::kLong && cu.is_contiguous(),
              "gdn_recurrent_f32: cu_seqlens contiguous int64 [N + 1]");
  const int64_t N = cu.size(0) - 1;
  const int64_t* cp = cu.data_ptr<int64_t>();
  TORCH_CHECK(cp[0] == 0 && cp[N] == T, "gdn_recurrent_f32: cu_seqlens from 0 to T");
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(cp[n + 1] >= cp[n], "gdn_recurrent_f32: cu_seqlens must not fall");
  return N;
}

// Every pair of the stream; pair (n, hv) starts from s0(n) + hv * dk * dv (nullptr: zeros) and
// ends in s1(n) + hv * dk * dv (nullptr: not kept). s0 and s1 may be the same memory: a strip is
// read whole before any of it is written, and no two pairs share a state.
template <class In, class Out>
at::Tensor run_stream(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                      const at::Tensor& beta, const at::Tensor& cu, double scale, In s0, Out s1) {
  const int64_t T = q.size(0), Hk = q.size(1), dk = q.size(2), Hv = v.size(1), dv = v.size(2), N = cu.size(0) - 1;
  int64_t dkp = 1;
  while (dkp < dk) dkp *= 2;
  at::Tensor o = at::empty({T, Hv, dv}, v.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const int64_t* cp = cu.data_ptr<int64_t>();
  float* op = o.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t group = Hv / Hk;
  at::parallel_for(0, N * Hv, 1, [&](int64_t p0, int64_t p1) {
    std::vector<vec> Sb(dkp), P(dkp);
    std::vector<float> kt(dkp), qt(dkp), sink(dk * dv);
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t n = pair / Hv, hv = pair % Hv;
      const float* in = s0(n);
      float* out = s1(n);
      run_pair(qp, kp, vp, ap, bp, cp[n], cp[n + 1], Hk, Hv, dk, dkp, dv, hv, hv / group, sc,
               in == nullptr ? nullptr : in + hv * dk * dv, out == nullptr ? sink.data() : out + hv * dk * dv,
               Sb.data(), P.data(), kt.data(), qt.data(), op);
    }
  });
  return o;
}

// initial [N, Hv, dk, dv] fp32, or an empty tensor for zeros (read only). Returns (o [T, Hv, dv],
// the final state [N, Hv, dk, dv]), fp32.
std::tuple<at::Tensor, at::Tensor> gdn_recurrent_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& a, const at::Tensor& beta, const at::Tensor& cu,
                                                     const at::Tensor& initial, double scale) {
  const int64_t N = check_stream(q, k, v, a, beta, cu);
  const int64_t Hv = v.size(1), dk = q.size(2), dv = v.size(2);
  const bool zeros = initial.numel() == 0;
  TORCH_CHECK(zeros || (initial.scalar_type() == at::kFloat && initial.is_contiguous() && initial.dim() == 4 &&
                        initial.size(0) == N && initial.size(1) == Hv && initial.size(2) == dk && initial.size(3) == dv),
              "gdn_recurrent_f32: initial state contiguous fp32 [N, Hv, dk, dv] or empty");
  at::Tensor fin = at::empty({N, Hv, dk, dv}, v.options());
  const float* ip = zeros ? nullptr : initial.data_ptr<float>();
  float* fp = fin.data_ptr<float>();
  const int64_t row = Hv * dk * dv;
  at::Tensor o = run_stream(
      q, k, v, a, beta, cu, scale, [&](int64_t n) -> const float* { return ip == nullptr ? nullptr : ip + n * row; },
      [&](int64_t n) -> float* { return fp + n * row; });
  return {o, fin};
}

// The same step with the states in rows of a cache, updated in place (the engine's state cache:
// no gather before the step and no scatter after). cache [R, Hv, dk, dv] fp32, each row contiguous
// (rows may lie any stride apart); sequence n starts from row rows_in[n] (-1: zeros) and its final
// state is written to row rows_out[n] (-1: not kept). Distinct sequences must not share a row
// they write. Returns o [T, Hv, dv] fp32.
at::Tensor gdn_recurrent_rows_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                                  const at::Tensor& beta, const at::Tensor& cu, const at::Tensor& cache,
                                  const at::Tensor& rows_in, const at::Tensor& rows_out, double scale) {
  const int64_t N = check_stream(q, k, v, a, beta, cu);
  const int64_t Hv = v.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(cache.dim() == 4 && cache.size(1) == Hv && cache.size(2) == dk &&
                  cache.size(3) == dv && cache.stride(3) == 1 && cache.stride(2) == dv && cache.stride(1) == dk * dv,
              "gdn_recurrent_rows_f32: cache [R, Hv, dk, dv], each row contiguous");
  const CacheRowPointers rows = cache_rows(cache, rows_in, rows_out, N, "gdn_recurrent_rows_f32");
  return run_stream(
      q, k, v, a, beta, cu, scale, [&](int64_t n) { return rows.in(n); }, [&](int64_t n) { return rows.out(n); });
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("gdn_recurrent_f32(Tensor q, Tensor k, Tensor v, Tensor a, Tensor beta, Tensor cu_seqlens, Tensor initial, "
        "float scale) -> (Tensor, Tensor)",
        &titan_rl::gdn_recurrent_f32);
  m.def("gdn_recurrent_rows_f32(Tensor q, Tensor k, Tensor v, Tensor a, Tensor beta, Tensor cu_seqlens, "
        "Tensor(a!) cache, Tensor rows_in, Tensor rows_out, float scale) -> Tensor",
        &titan_rl::gdn_recurrent_rows_f32);
}
