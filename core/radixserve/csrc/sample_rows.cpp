// One draw per row from softmax(logits / temperature), in one kernel.
//
// Why: the torch sampler builds the [rows, vocab] probabilities, then an Exp(1) noise tensor
// (torch's CPU exponential_ costs ~40 ns a value, one thread: ~30 ms for 16 x 49k logits, a fifth of
// a batch-16 SmolLM2 decode step), then divides and takes the argmax: five passes and three
// [rows, vocab] tensors. Here a row is two passes over its logits (the maximum, then the
// unnormalised probabilities with their sums per block of columns) and an inverse-CDF search: one
// uniform per row, made from the row's key by splitmix64, so a row's draw depends only on its key
// (a seeded request draws the same alone or batched). Sums are fp32 within a block of 256 columns
// and fp64 across blocks.
// Only the headers these kernels use (see cpu_ops.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "row_argmax.h"

namespace {

inline bool is_finite_bits(uint32_t u) { return (u & 0x7f800000u) != 0x7f800000u; }  // -ffast-math hides isinf

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

using rs::row_argmax;

inline uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr int64_t kBlock = 256;
// exp(-80) = 2e-35: a token this far below the maximum is never drawn in practice (its share is
// under 1e-30 even over a 10^5-token vocabulary); treating it as 0 changes no draw that matters
constexpr float kMinExponent = -80.f;  // columns per partial sum of the inverse-CDF search

// One draw for a row whose maximum `top` is finite: p_j = exp((l_j - top) / T) (unnormalised,
// the maximum has p = 1), then the first j whose running sum exceeds u * sum p for one uniform u
// made from the row's key. `p` is scratch of n floats, `partial` of ceil(n / kBlock) doubles.
int64_t row_draw(const float* r, int64_t n, float inv_t, float top, uint64_t key, float* p, double* partial) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
    float s = 0.f;
    // exp(<= 0) in [0, 1]. Below kMinExponent p is 0: that keeps -inf logits (banned tokens) at
    // exactly 0, and every lane of the vector exp in its fast range (its underflow path is scalar)
#pragma omp simd reduction(+ : s)
    for (int64_t j = lo; j < hi; ++j) {
      const float x = (r[j] - top) * inv_t;
      const float e = std::exp(std::max(x, kMinExponent));
      p[j] = x > kMinExponent ? e : 0.f;
      s += p[j];
    }
    partial[b] = s;
    total += s;
  }
  const double u = static_cast<double>(splitmix64(key) >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
  double rest = u * total;
  int64_t b = 0;
  while (b + 1 < blocks && rest >= partial[b]) rest -= partial[b++];
  // within the block: the first column whose running sum passes `rest` (a column of p = 0 never
  // does); if rounding leaves `rest` at or past the block's sum, its last column with p > 0
  const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
  double acc = 0.0;
  int64_t last = -1;
  for (int64_t j = lo; j < hi; ++j) {
    if (p[j] > 0.f) last = j;
    acc += p[j];
    if (acc > rest && p[j] > 0.f) return j;
  }
  return last >= 0 ? last : row_argmax(r, n);
}

}  // namespace

// logits [rows, V] fp32 (contiguous rows), inv_temperatures [rows] fp32, greedy [rows] bool,
// keys [rows] int64. Returns int64 [rows]: greedy rows their torch.argmax, the others one draw from
// softmax(logits * inv_temperature) keyed by their key; -1 for a sampled row whose logits hold a
// NaN or +inf or are all -inf (the caller decides what such a row gets).
at::Tensor sample_rows(at::Tensor logits, at::Tensor inv_temperatures, at::Tensor greedy, at::Tensor keys) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "sample_rows: logits fp32 [rows, V] with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(inv_temperatures.scalar_type() == at::kFloat && inv_temperatures.is_contiguous() &&
                  inv_temperatures.numel() == rows, "sample_rows: inv_temperatures fp32 [rows]");
  TORCH_CHECK(greedy.scalar_type() == at::kBool && greedy.is_contiguous() && greedy.numel() == rows,
              "sample_rows: greedy bool [rows]");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.is_contiguous() && keys.numel() == rows,
              "sample_rows: keys int64 [rows]");
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* tp = inv_temperatures.data_ptr<float>();
  const bool* gp = greedy.data_ptr<bool>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    std::vector<float> p(static_cast<size_t>(n));
    std::vector<double> partial(static_cast<size_t>((n + kBlock - 1) / kBlock));
    for (int64_t i = b; i < e; ++i) {
      const float* r = lp + i * ld;
      const int64_t top_idx = row_argmax(r, n);
      const uint32_t top = bits_of(r[top_idx]);
      if (gp[i]) {
        op[i] = top_idx;
      } else if (!is_finite_bits(top)) {  // NaN, +inf, or a row of -inf
        op[i] = -1;
      } else {
        op[i] = row_draw(r, n, tp[i], r[top_idx], static_cast<uint64_t>(kp[i]), p.data(), partial.data());
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_rows", &sample_rows, "one exponential-race draw per row of fp32 logits (greedy rows: argmax)");
}
