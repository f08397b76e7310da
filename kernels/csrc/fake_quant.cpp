// Fake quantization (quantize, then dequantize to the input's dtype) in one pass per row,
// exactly torchao's compositions (kernels/quant/torch_impl.py).
//
// fp8_rowwise:
//   amax  = |x|.amax(row)                  in x's dtype (exact: a max)
//   amax  = clamp(amax, min = AMAX_EPS)    the floor, as a value of x's dtype
//   scale = fp32(amax / 448)               the division in x's dtype (bf16: fp32, rounded)
//   q     = e4m3(clamp(fp32(x) / scale, -448, 448))
//   out   = x.dtype(fp32(q) * scale)
// Each conversion is c10's own (the function torch's .to() calls), each operation one
// IEEE operation on fp32 values, so the result is bit-for-bit torchao's.
//
// nvfp4 (weights: one global scale g over the tensor; nvfp4_w4a4 activations: one per row):
//   g     = max(fp32(amax) / 2688, 2^-120)            2688 = 448 * 6
//   per block of 16: e = e4m3(clamp(fp32(amax_b) / 6 / g, 2^-6, 448))
//   q     = e2m1(clamp(fp32(x) * ((1 / g) / e), -6, 6))   (torchao multiplies by the reciprocal)
//   out   = x.dtype(q * (g * e))
//
// Why: torchao's forms are 8-20 tensor ops per call; at decode shapes (a few rows) the
// calls, not the arithmetic, cost ~100 us per linear, more than the GEMM, and the
// trainer fake-quantizes every weight on every forward. One fused pass per row here;
// rows are independent (the weight's global amax is one exact max first), so the bits do
// not depend on the batch or the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "common.h"
#include "quant_common.h"

namespace titan_rl {
namespace {

template <typename T>
void fake_quant_rows(const T* x, T* out, int64_t N, int64_t K, float eps) {
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      T* yr = out + r * K;
      const float s = row_scale(xr, K, eps);
      for (int64_t j = 0; j < K; ++j) {
        float v = to_f(xr[j]) / s;
        v = v < -FP8_MAX ? -FP8_MAX : (v > FP8_MAX ? FP8_MAX : v);  // clamp; NaN passes
        const float q = round_e4m3(v);
        yr[j] = from_f<T>(q * s);
      }
    }
  });
}

template <typename T>
void nvfp4_rows(const T* x, T* out, int64_t N, int64_t K, bool per_row, float g_min) {
  float g_all = 0.0f;
  if (!per_row) {
    g_all = abs_max(x, N * K) / NVFP4_GLOBAL_DIV;
    g_all = g_all < g_min ? g_min : g_all;
  }
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      T* yr = out + r * K;
      float g = g_all;
      if (per_row) {
        g = abs_max(xr, K) / NVFP4_GLOBAL_DIV;
        g = g < g_min ? g_min : g;
      }
      const float inv_g = 1.0f / g;
      for (int64_t b = 0; b < K; b += NVFP4_BLOCK) {
        float sb = abs_max(xr + b, NVFP4_BLOCK) / F4_MAX / g;
        sb = sb < E4M3_TINY ? E4M3_TINY : (sb > FP8_MAX ? FP8_MAX : sb);  // NaN passes
        const float e = round_e4m3(sb);
        const float recip = inv_g / e, hp = g * e;
        for (int64_t j = b; j < b + NVFP4_BLOCK; ++j) {
          float v = to_f(xr[j]) * recip;
          v = v < -F4_MAX ? -F4_MAX : (v > F4_MAX ? F4_MAX : v);
          yr[j] = from_f<T>(round_e2m1(v) * hp);
        }
      }
    }
  });
}

at::Tensor nvfp4_fake_quant(const at::Tensor& x_in, bool per_row, double g_min) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % NVFP4_BLOCK == 0, "nvfp4_fake_quant: [rows, K], K a multiple of 16");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t N = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    nvfp4_rows(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), N, K, per_row, static_cast<float>(g_min));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "nvfp4_fake_quant: bfloat16 or float32");
    nvfp4_rows(x.data_ptr<float>(), out.data_ptr<float>(), N, K, per_row, static_cast<float>(g_min));
  }
  return out;
}

at::Tensor fp8_rowwise_fake_quant(const at::Tensor& x_in, double eps) {
  TORCH_CHECK(x_in.dim() == 2, "fp8_rowwise_fake_quant: a 2D tensor [rows, K]");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t N = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    fake_quant_rows(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), N, K, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "fp8_rowwise_fake_quant: bfloat16 or float32");
    fake_quant_rows(x.data_ptr<float>(), out.data_ptr<float>(), N, K, static_cast<float>(eps));
  }
  return out;
}

}  // namespace
}  // namespace titan_rl

TORCH_LIBRARY_FRAGMENT(titan_rl, m) {
  m.def("fp8_rowwise_fake_quant(Tensor x, float eps) -> Tensor", &titan_rl::fp8_rowwise_fake_quant);
  m.def("nvfp4_fake_quant(Tensor x, bool per_row, float g_min) -> Tensor", &titan_rl::nvfp4_fake_quant);
}
