// Elementwise ops whose bits do not depend on the element's position or the buffer's
// size. ATen's vectorised loops compute a buffer's tail (and each thread chunk's tail)
// on a scalar path whose transcendentals round differently from the SIMD ones, so with
// a width that is not a multiple of the vector length a row's bits change with the row
// count (F.silu at width 200). Here every element goes through the same IEEE
// operations (common.h), vectorised or not.
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

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

void exp_f32(const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_f(x[i]);
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(), "silu_mul: shapes/dtypes differ");
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor o = at::empty_like(g);
  const int64_t n = g.numel();
  if (g.scalar_type() == at::kFloat) {
    const float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
    float* op = o.data_ptr<float>();
    at::parallel_for(0, n, 16384, [=](int64_t b, int64_t e) { silu_mul_f32(gp + b, up + b, op + b, e - b); });
  } else if (g.scalar_type() == at::kBFloat16) {
    auto gp = reinterpret_cast<const uint16_t*>(g.data_ptr<c10::BFloat16>());
    auto up = reinterpret_cast<const uint16_t*>(u.data_ptr<c10::BFloat16>());
    auto op = reinterpret_cast<uint16_t*>(o.data_ptr<c10::BFloat16>());
    at::parallel_for(0, n, 16384, [=](int64_t b, int64_t e) { silu_mul_bf16(gp + b, up + b, op + b, e - b); });
  } else {
    TORCH_CHECK(false, "silu_mul: float32 or bfloat16 only");
  }
  return o;
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
  m.def("exp_fixed(Tensor x) -> Tensor", &titan_rl::exp_fixed);
}
