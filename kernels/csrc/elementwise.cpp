// Elementwise ops whose bits do not depend on the element's position or the buffer's
// size. ATen's vectorised loops compute a buffer's tail (and each thread chunk's tail)
// on a scalar path whose transcendentals round differently from the SIMD ones, so with
// a width that is not a multiple of the vector length a row's bits change with the row
// count (F.silu at width 200). Here every element goes through the same IEEE
// operations (common.h), vectorised or not.
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

namespace titan_rl {
namespace {

inline float silu_f(float x) { return x / (1.0f + exp_f(-x)); }

// silu(gate) * up, the SwiGLU activation. Low-precision inputs follow torch's rounding:
// silu computed in fp32 and rounded to the dtype, then the product in fp32, rounded.
void silu_mul_f32(const float* __restrict g, const float* __restrict u, float* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = silu_f(g[i]) * u[i];
}

void silu_mul_bf16(const uint16_t* __restrict g, const uint16_t* __restrict u, uint16_t* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = bf16_to_f(f_to_bf16(silu_f(bf16_to_f(g[i]))));
    o[i] = f_to_bf16(s * bf16_to_f(u[i]));
  }
}

// The gradient of silu(g) * u, every element alone in fp32 from its own grad, gate and
// up (rounded once to the storage type at the end): sig = 1 / (1 + exp(-g)),
// d_gate = grad * u * sig * (1 + g * (1 - sig)), d_up = grad * (g * sig).
inline float ld(float x) { return x; }
inline float ld(uint16_t x) { return bf16_to_f(x); }
inline void st(float& o, float v) { o = v; }
inline void st(uint16_t& o, float v) { o = f_to_bf16(v); }

template <typename S>
void silu_mul_bwd_span(const S* __restrict gr, const S* __restrict g, const S* __restrict u, S* __restrict dg,
                       S* __restrict du, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gv = ld(g[i]), gd = ld(gr[i]);
    const float sig = 1.0f / (1.0f + exp_f(-gv));
    st(dg[i], gd * ld(u[i]) * sig * (1.0f + gv * (1.0f - sig)));
    st(du[i], gd * (gv * sig));
  }
}

void exp_f32(const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_f(x[i]);
}

// Rows of a [M, I] operand: unit column stride, any row stride (gate and up are often the
// two halves of one [M, 2I] GEMM output, read in place).
at::Tensor rows_of(const at::Tensor& t) { return t.dim() == 2 && t.stride(1) == 1 ? t : t.contiguous(); }

at::Tensor silu_mul(const at::Tensor& gate_in, const at::Tensor& up_in) {
  TORCH_CHECK(gate_in.dim() == 2 && gate_in.sizes() == up_in.sizes() && gate_in.scalar_type() == up_in.scalar_type(),
              "silu_mul: [M, I] operands of one shape and dtype expected");
  const at::Tensor g = rows_of(gate_in), u = rows_of(up_in);
  const int64_t M = g.size(0), I = g.size(1), gs = g.stride(0), us = u.stride(0);
  at::Tensor o = at::empty({M, I}, g.options());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1));
  if (g.scalar_type() == at::kFloat) {
    const float *gp = g.data_ptr<float>(), *upp = u.data_ptr<float>();
    float* op = o.data_ptr<float>();
    at::parallel_for(0, M, grain, [=](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_mul_f32(gp + r * gs, upp + r * us, op + r * I, I);
    });
  } else if (g.scalar_type() == at::kBFloat16) {
    auto gp = reinterpret_cast<const uint16_t*>(g.data_ptr<c10::BFloat16>());
    auto upp = reinterpret_cast<const uint16_t*>(u.data_ptr<c10::BFloat16>());
    auto op = reinterpret_cast<uint16_t*>(o.data_ptr<c10::BFloat16>());
    at::parallel_for(0, M, grain, [=](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_mul_bf16(gp + r * gs, upp + r * us, op + r * I, I);
    });
  } else {
    TORCH_CHECK(false, "silu_mul: float32 or bfloat16 only");
  }
  return o;
}

// d_gate, d_up of silu_mul for `grad` ([M, I] each, one dtype: float32 or bfloat16).
// Where gate and up are the two halves of one [M, 2I] tensor, d_gate and d_up are the
// two halves of one [M, 2I] buffer (kernels/autograd.py's split_last then passes that
// buffer on as the fused GEMM's gradient without a copy).
std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate_in,
                                                     const at::Tensor& up_in) {
  TORCH_CHECK(gate_in.dim() == 2 && gate_in.sizes() == up_in.sizes() && grad.sizes() == gate_in.sizes() &&
                  gate_in.scalar_type() == up_in.scalar_type() && grad.scalar_type() == gate_in.scalar_type(),
              "silu_mul_backward: [M, I] operands of one shape and dtype expected");
  const at::Tensor gr = rows_of(grad), g = rows_of(gate_in), u = rows_of(up_in);
  const int64_t M = g.size(0), I = g.size(1), rs = gr.stride(0), gs = g.stride(0), us = u.stride(0);
  const bool halves = gs == 2 * I && us == 2 * I &&
                      static_cast<const char*>(u.data_ptr()) == static_cast<const char*>(g.data_ptr()) + I * g.element_size();
  at::Tensor dg, du;
  if (halves) {
    const at::Tensor buf = at::empty({M, 2 * I}, g.options());
    dg = buf.narrow(1, 0, I);
    du = buf.narrow(1, I, I);
  } else {
    dg = at::empty({M, I}, g.options());
    du = at::empty({M, I}, g.options());
  }
  const int64_t os = dg.stride(0);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1));
  if (g.scalar_type() == at::kFloat) {
    const float *rp = gr.data_ptr<float>(), *gp = g.data_ptr<float>(), *upp = u.data_ptr<float>();
    float *a = dg.data_ptr<float>(), *b = du.data_ptr<float>();
    at::parallel_for(0, M, grain, [=](int64_t s, int64_t e) {
      for (int64_t r = s; r < e; ++r)
        silu_mul_bwd_span<float>(rp + r * rs, gp + r * gs, upp + r * us, a + r * os, b + r * os, I);
    });
  } else if (g.scalar_type() == at::kBFloat16) {
    using U = uint16_t;
    auto p = [](const at::Tensor& t) { return reinterpret_cast<U*>(t.data_ptr<c10::BFloat16>()); };
    const U *rp = p(gr), *gp = p(g), *upp = p(u);
    U *a = p(dg), *b = p(du);
    at::parallel_for(0, M, grain, [=](int64_t s, int64_t e) {
      for (int64_t r = s; r < e; ++r) silu_mul_bwd_span<U>(rp + r * rs, gp + r * gs, upp + r * us, a + r * os, b + r * os, I);
    });
  } else {
    TORCH_CHECK(false, "silu_mul_backward: float32 or bfloat16 only");
  }
  return {dg, du};
}

// exp(x) elementwise in fp32 (the attention kernel's exp_f), for tests and the
// reference comparison of the polynomial.
at::Tensor exp_fixed(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "exp_fixed: float32 only");
  const at::Tensor c = x.contiguous();
  at::Tensor o = at::empty_like(c);
  const float* p = c.data_ptr<float>();
  float* q = o.data_ptr<float>();
  at::parallel_for(0, c.numel(), 16384, [=](int64_t b, int64_t e) { exp_f32(p + b, q + b, e - b); });
  return o;
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor", &titan_rl::silu_mul);
  m.def("silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)", &titan_rl::silu_mul_backward);
  m.def("exp_fixed(Tensor x) -> Tensor", &titan_rl::exp_fixed);
}
