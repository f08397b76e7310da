// The fp32 vector the FMA-chain GEMMs (f32_chain.cpp, weight_grad.cpp) and the GDN step
// (gdn_recurrent.cpp) are written in: AVX-512 (16 lanes), AVX2 + FMA (8) or a scalar loop (8).
// Lanes are independent and each operation is one correctly rounded IEEE operation per lane (vfma
// a fused multiply-add), so the width never changes a lane's bits.
#pragma once

#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace titan_rl {
namespace fp32v {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int VW = 16;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vzero() { return _mm512_setzero_ps(); }
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int VW = 8;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vzero() { return _mm256_setzero_ps(); }
#else
struct vec { float v[8]; };
constexpr int VW = 8;
inline vec vload(const float* p) { vec r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void vstore(float* p, vec v) { std::memcpy(p, v.v, sizeof v.v); }
inline vec vbcast(const float* p) { vec r; for (float& x : r.v) x = *p; return r; }
inline vec vfma(vec a, vec b, vec c) {
  for (int i = 0; i < 8; ++i) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline vec vadd(vec a, vec b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline vec vsub(vec a, vec b) {
  for (int i = 0; i < 8; ++i) a.v[i] -= b.v[i];
  return a;
}
inline vec vmul(vec a, vec b) {
  for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
  return a;
}
inline vec vzero() { return vec{}; }
#endif

}  // namespace fp32v
}  // namespace titan_rl
