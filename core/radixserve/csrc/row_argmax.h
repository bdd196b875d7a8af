// torch.argmax of one fp32 row, shared by the kernels that need it (cpu_ops.cpp argmax_rows,
// sample_rows.cpp). A header edit rebuilds every kernel that includes it: radixserve.native
// hashes a source's quoted local includes into its cache key.
#pragma once

#include <algorithm>
#include <cstdint>

namespace rs {

using bits32 = uint32_t __attribute__((__may_alias__));  // a float's bits, read in place

// NaN tests on the bits: -ffast-math lets the compiler assume x == x.
inline bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// The first index of the largest of r[0..n), n >= 1, a NaN counting as the largest (the first
// NaN wins), as torch.argmax. One vectorised pass for the maximum, then a scan for its first
// index.
inline int64_t row_argmax(const float* r, int64_t n) {
  const bits32* u = reinterpret_cast<const bits32*>(r);
  float best = r[0];
  uint32_t nans = 0;
#pragma omp simd reduction(max : best) reduction(| : nans)
  for (int64_t j = 0; j < n; ++j) {
    best = std::max(best, r[j]);
    nans |= static_cast<uint32_t>(is_nan_bits(u[j]));
  }
  int64_t idx = 0;
  if (nans) {
    while (!is_nan_bits(u[idx])) ++idx;
    return idx;
  }
  while (idx < n && r[idx] != best) ++idx;  // a float compare: -0 ties with +0, as in torch
  // no value equals the maximum only in a row of -inf (-ffast-math's max reduction may start
  // at -FLT_MAX instead of -inf): torch's answer is then the first index
  return idx < n ? idx : 0;
}

}  // namespace rs
