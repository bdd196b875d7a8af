// One draw per row from softmax(logits / temperature) by the exponential race, in one kernel.
//
// Why: the torch sampler builds the [rows, vocab] probabilities, then an Exp(1) noise tensor
// (torch's CPU exponential_ costs ~40 ns a value, one thread: ~30 ms for 16 x 49k logits, a fifth of
// a batch-16 SmolLM2 decode step), then divides and takes the argmax: five passes and three
// [rows, vocab] tensors. Here each row is two passes over its logits (max, then race) with the noise
// made on the fly by a counter-based generator: value v of a row keyed k is a hash of (k, v), so a
// row's draws depend only on its key (a seeded request draws the same numbers alone or batched).
//
// The race: argmax_v p_v / E_v with E_v ~ Exp(1) i.i.d. is a draw from p (the minimum of the
// E_v / p_v is attained at v with probability p_v); p_v = exp((l_v - max l) / T) unnormalised (the
// argmax does not see the normalisation). E = -log U, U uniform in (0, 1) from 24 hash bits.
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

namespace {

inline uint32_t mix32(uint32_t x) {  // a full-avalanche 32-bit integer hash (two multiply rounds)
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

inline bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }  // -ffast-math hides isnan
inline bool is_finite_bits(uint32_t u) { return (u & 0x7f800000u) != 0x7f800000u; }

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// torch.argmax of one row: the first index of the largest value, the first NaN winning.
int64_t row_argmax(const float* r, int64_t n) {
  float best = r[0];
  uint32_t nans = 0;
  const uint32_t* u = reinterpret_cast<const uint32_t*>(r);
#pragma omp simd reduction(max : best) reduction(| : nans)
  for (int64_t j = 0; j < n; ++j) {
    best = std::max(best, r[j]);
    nans |= static_cast<uint32_t>(is_nan_bits(u[j]));
  }
  int64_t idx = 0;
  if (nans) {
    while (!is_nan_bits(u[idx])) ++idx;
  } else {
    while (r[idx] != best) ++idx;
  }
  return idx;
}

// The race for one row whose maximum `top` is finite; `score` is scratch of n floats.
int64_t row_race(const float* r, int64_t n, float inv_t, float top, uint64_t key, float* score) {
  const uint32_t k0 = mix32(static_cast<uint32_t>(key) ^ 0x9e3779b9u);
  const uint32_t k1 = mix32(static_cast<uint32_t>(key >> 32) + k0);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t h = mix32(mix32(static_cast<uint32_t>(j) * 0x9e3779b9u + k0) ^ k1);
    const float u = (static_cast<float>(h >> 8) + 0.5f) * (1.f / 16777216.f);  // in (0, 1), never 0 or 1
    // p / E; p = exp(<= 0) in [0, 1], E = -log u > 0. Logits of -inf give p = 0 (never drawn
    // unless every p is 0, impossible: the maximum has p = 1).
    score[j] = std::exp(std::max((r[j] - top) * inv_t, -104.f)) / -std::log(u);
  }
  float best = score[0];
#pragma omp simd reduction(max : best)
  for (int64_t j = 0; j < n; ++j) best = std::max(best, score[j]);
  int64_t idx = 0;
  while (score[idx] != best) ++idx;
  return idx;
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
    std::vector<float> score(static_cast<size_t>(n));
    for (int64_t i = b; i < e; ++i) {
      const float* r = lp + i * ld;
      const int64_t top_idx = row_argmax(r, n);
      const uint32_t top = bits_of(r[top_idx]);
      if (gp[i]) {
        op[i] = top_idx;
      } else if (!is_finite_bits(top)) {  // NaN, +inf, or a row of -inf
        op[i] = -1;
      } else {
        op[i] = row_race(r, n, tp[i], r[top_idx], static_cast<uint64_t>(kp[i]), score.data());
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_rows", &sample_rows, "one exponential-race draw per row of fp32 logits (greedy rows: argmax)");
}
