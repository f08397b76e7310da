// GDN's depthwise causal conv, compiled: the same IEEE operations as the torch form in
// kernels/gdn/torch_impl.py (`causal_conv1d_torch`, the definition this is pinned to with
// torch.equal). Per sequence the inputs form an extended stream: its K-1 history entries (the
// carried conv state, zeros without one), then its tokens; token j's output is
//   y = w[0] * e[j] + w[1] * e[j + 1] + ... + w[K-1] * e[j + K-1]
// over entries j .. j+K-1, each product rounded to fp32, summed left to right (no FMA), and the
// final state is the last K-1 entries. Every operation is per channel, so channels run in blocks
// of any width and an output's bits depend on nothing but its own channel's inputs: not the other
// sequences, the thread count or how the stream was cut into calls.
//
// The torch form builds the extended stream as a tensor and runs ~20 tensor ops (a gather,
// product and sum per tap over all tokens): 1.2 ms a decode step of 8 sequences and 64 ms a
// prefill of 832 tokens at Qwen3.5-0.8B's 6144 channels. Here a block's last K entries stay in
// a ring in L1.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cache_rows.h"
#include "common.h"
#include "fp32_vec.h"

namespace titan_rl {
namespace {

using namespace fp32v;

constexpr int64_t CB = 128;  // channels per block: a K-entry ring of 128 floats each

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// checks x [T, C] and w [C, K] (fp32 or bf16, contiguous), cu [N + 1]; returns N
int64_t check_conv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cu) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && float_or_bf16(x), "causal_conv1d_f32: x contiguous [T, C], fp32 or bf16");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && float_or_bf16(w) && w.size(0) == x.size(1) && w.size(1) >= 1,
              "causal_conv1d_f32: weight contiguous [C, K], fp32 or bf16, K >= 1");
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1 && cu.scalar_type() == at::kLong && cu.is_contiguous(),
              "causal_conv1d_f32: cu_seqlens contiguous int64 [N + 1]");
  const int64_t N = cu.size(0) - 1;
  const int64_t* cp = cu.data_ptr<int64_t>();
  TORCH_CHECK(cp[0] == 0 && cp[N] == x.size(0), "causal_conv1d_f32: cu_seqlens from 0 to T");
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(cp[n + 1] >= cp[n], "causal_conv1d_f32: cu_seqlens must not fall");
  return N;
}

// One sequence's tokens [t0, t0 + L) in channels [c0, c0 + cw): its history from init [C, H]
// (nullptr: zeros), its final state to fin [C, H] (nullptr: not kept). ring [K][CB]: entry e of
// the extended stream in row e % K; wt [K][CB]: the block's weight, tap-major.
template <class X>
void conv_block(const X* __restrict xp, const float* __restrict wt, const float* init, float* fin, X* __restrict yp,
                float* ring, int64_t C, int64_t K, int64_t t0, int64_t L, int64_t c0, int64_t cw) {
  const int64_t H = K - 1;
  for (int64_t h = 0; h < H; ++h) {  // entry h: history
    float* r = ring + (h % K) * CB;
    for (int64_t j = 0; j < cw; ++j) r[j] = init == nullptr ? 0.0f : init[(c0 + j) * H + h];
  }
  for (int64_t j = 0; j < L; ++j) {  // token j is entry H + j
    float* r = ring + ((H + j) % K) * CB;
    const X* __restrict xr = xp + (t0 + j) * C + c0;
    for (int64_t c = 0; c < cw; ++c) r[c] = to_f(xr[c]);
    // whole vectors, then the tail one lane at a time: the same mul and add per lane either way
    float yr[CB];
    const float* e0 = ring + (j % K) * CB;
    int64_t c = 0;
    for (; c + VW <= cw; c += VW) {
      vec acc = vmul(vload(wt + c), vload(e0 + c));
      for (int64_t i = 1; i < K; ++i) acc = vadd(acc, vmul(vload(wt + i * CB + c), vload(ring + ((j + i) % K) * CB + c)));
      vstore(yr + c, acc);
    }
    for (; c < cw; ++c) {
      float acc = wt[c] * e0[c];
      for (int64_t i = 1; i < K; ++i) acc = acc + wt[i * CB + c] * ring[((j + i) % K) * CB + c];
      yr[c] = acc;
    }
    X* out = yp + (t0 + j) * C + c0;  // rounded to x's dtype (nearest even) as the torch form's .to()
    for (c = 0; c < cw; ++c) out[c] = from_f<X>(yr[c]);
  }
  if (fin != nullptr)
    for (int64_t h = 0; h < H; ++h) {  // the last H entries: L .. L + H - 1
      const float* r = ring + ((L + h) % K) * CB;
      for (int64_t j = 0; j < cw; ++j) fin[(c0 + j) * H + h] = r[j];
    }
}

// Every (sequence, channel block); sequence n's history comes from s0(n) [C, K-1] (nullptr:
// zeros) and its final state goes to s1(n) [C, K-1] (nullptr: not kept). s0 and s1 may be the
// same memory: a block reads its history before any token and writes its state after the last.
template <class X, class W, class In, class Out>
at::Tensor conv_stream(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cu, In s0, Out s1) {
  const int64_t T = x.size(0), C = x.size(1), K = w.size(1), N = cu.size(0) - 1;
  const int64_t nb = (C + CB - 1) / CB;
  at::Tensor y = at::empty({T, C}, x.options());
  const X* xp = reinterpret_cast<const X*>(x.data_ptr());
  const W* wp = reinterpret_cast<const W*>(w.data_ptr());
  const int64_t* cp = cu.data_ptr<int64_t>();
  X* yp = reinterpret_cast<X*>(y.data_ptr());
  // sequence-major tasks: a sequence's rows stay in cache across its blocks
  at::parallel_for(0, N * nb, 1, [&](int64_t k0, int64_t k1) {
    std::vector<float> ring(K * CB), wt(K * CB);
    for (int64_t task = k0; task < k1; ++task) {
      const int64_t n = task / nb, c0 = (task % nb) * CB, cw = std::min(CB, C - c0);
      for (int64_t i = 0; i < K; ++i)
        for (int64_t c = 0; c < cw; ++c) wt[i * CB + c] = to_f(wp[(c0 + c) * K + i]);
      conv_block<X>(xp, wt.data(), s0(n), s1(n), yp, ring.data(), C, K, cp[n], cp[n + 1] - cp[n], c0, cw);
    }
  });
  return y;
}

template <class In, class Out>
at::Tensor conv_any(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cu, In s0, Out s1) {
  const bool xb = x.scalar_type() == at::kBFloat16, wb = w.scalar_type() == at::kBFloat16;
  if (xb && wb) return conv_stream<c10::BFloat16, c10::BFloat16>(x, w, cu, s0, s1);
  if (xb) return conv_stream<c10::BFloat16, float>(x, w, cu, s0, s1);
  if (wb) return conv_stream<float, c10::BFloat16>(x, w, cu, s0, s1);
  return conv_stream<float, float>(x, w, cu, s0, s1);
}

// initial [N, C, K-1] fp32 contiguous, or empty for zeros. Returns (y [T, C] in x's dtype, final
// [N, C, K-1] fp32).
std::tuple<at::Tensor, at::Tensor> causal_conv1d_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cu,
                                                     const at::Tensor& initial) {
  const int64_t N = check_conv(x, w, cu), C = x.size(1), H = w.size(1) - 1;
  const bool zeros = initial.numel() == 0;
  TORCH_CHECK(zeros || (initial.scalar_type() == at::kFloat && initial.is_contiguous() && initial.dim() == 3 &&
                        initial.size(0) == N && initial.size(1) == C && initial.size(2) == H),
              "causal_conv1d_f32: initial state contiguous fp32 [N, C, K-1] or empty");
  at::Tensor fin = at::empty({N, C, H}, x.options().dtype(at::kFloat));
  const float* ip = zeros ? nullptr : initial.data_ptr<float>();
  float* fp = fin.data_ptr<float>();
  at::Tensor y = conv_any(
      x, w, cu, [&](int64_t n) -> const float* { return ip == nullptr ? nullptr : ip + n * C * H; },
      [&](int64_t n) -> float* { return fp + n * C * H; });
  return {y, fin};
}

// The same conv with the states in rows of a cache, updated in place (the engine's conv state
// cache). cache [R, C, K-1] fp32, each row contiguous; sequence n's history from row rows_in[n]
// (-1: zeros), its final state to row rows_out[n] (-1: not kept); distinct sequences must not
// share a row they write. Returns y [T, C] in x's dtype.
at::Tensor causal_conv1d_rows_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cu,
                                  const at::Tensor& cache, const at::Tensor& rows_in, const at::Tensor& rows_out) {
  const int64_t N = check_conv(x, w, cu), C = x.size(1), H = w.size(1) - 1;
  TORCH_CHECK(cache.dim() == 3 && cache.size(1) == C && cache.size(2) == H &&
                  (H == 0 || (cache.stride(2) == 1 && cache.stride(1) == H)),
              "causal_conv1d_rows_f32: cache [R, C, K-1], each row contiguous");
  const CacheRowPointers rows = cache_rows(cache, rows_in, rows_out, N, "causal_conv1d_rows_f32");
  return conv_any(
      x, w, cu, [&](int64_t n) { return rows.in(n); }, [&](int64_t n) { return rows.out(n); });
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("causal_conv1d_f32(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor initial) -> (Tensor, Tensor)",
        &titan_rl::causal_conv1d_f32);
  m.def("causal_conv1d_rows_f32(Tensor x, Tensor weight, Tensor cu_seqlens, Tensor(a!) cache, Tensor rows_in, "
        "Tensor rows_out) -> Tensor",
        &titan_rl::causal_conv1d_rows_f32);
}
