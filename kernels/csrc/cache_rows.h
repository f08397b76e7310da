// States in rows of an engine's cache, read and written in place by a kernel (the GDN step and
// conv; kernels/gdn/cache_rows.py): sequence n starts from row rows_in[n] (-1: zeros) and its
// final state goes to row rows_out[n] (-1: not kept). A row holds one sequence's state
// contiguously; rows may lie any stride apart. The kernels take `in(n)` / `out(n)` pointers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace titan_rl {

struct CacheRowPointers {
  float* base;
  int64_t stride;
  const int64_t* ri;
  const int64_t* ro;
  const float* in(int64_t n) const { return ri[n] < 0 ? nullptr : base + ri[n] * stride; }
  float* out(int64_t n) const { return ro[n] < 0 ? nullptr : base + ro[n] * stride; }
};

// Checks the rows (contiguous int64 [N], each -1 or a row of the cache) and returns the pointers;
// the cache's own shape is the caller's to check.
inline CacheRowPointers cache_rows(const at::Tensor& cache, const at::Tensor& rows_in, const at::Tensor& rows_out,
                                   int64_t N, const char* op) {
  TORCH_CHECK(cache.scalar_type() == at::kFloat, op, ": an fp32 cache");
  for (const at::Tensor* t : {&rows_in, &rows_out})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == N && t->is_contiguous(), op,
                ": rows contiguous int64 [N]");
  const int64_t R = cache.size(0);
  const int64_t* ri = rows_in.data_ptr<int64_t>();
  const int64_t* ro = rows_out.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(ri[n] >= -1 && ri[n] < R && ro[n] >= -1 && ro[n] < R, op, ": a row outside the cache");
  return {cache.data_ptr<float>(), cache.stride(0), ri, ro};
}

}  // namespace titan_rl
