// Fused fp32 CPU kernels for the per-token layers: RMSNorm (+ residual add), SiLU-and-mul, rotary.
//
// Why: in a batched CPU decode step each of these is a chain of 4-8 small torch ops per layer
// (casts, reductions, cat, elementwise), each a dispatch plus a full pass over memory; one pass
// each here. Numerics follow the torch code of the layers (fp32 statistics, the same operations
// in the same order per element); only the order of the fp32 sum of squares differs.
// Only the headers these kernels use: torch/extension.h (the whole C++ frontend) takes ~4x the
// CPU time to parse, and a first start compiles every kernel (docs/architecture.md, start-up).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <tuple>

namespace {

// silu(g) = g / (1 + exp(-g)); the exponent is capped below fp32 overflow because -ffast-math
// assumes finite values (exp(-g) = inf would give NaN); at the cap silu(g) is already ~0.
constexpr float kExpMax = 88.f;

constexpr int64_t kRowsPerTask = 4;  // rows are small (hidden <= 16k floats): batch a few per task

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, ": fp32 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, ": expects [rows, cols] with contiguous rows");
}

inline void normalize_row(const float* r, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += r[j] * r[j];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = w[j] * (r[j] * inv);
}

}  // namespace

// norm(x) = weight * (x * rsqrt(mean(x^2) + eps)), row-wise. x: [rows, hidden].
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight shape");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), sx = x.stride(0);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) normalize_row(xp + i * sx, wp, op + i * n, n, static_cast<float>(eps));
  });
  return out;
}

// (norm(x + residual), x + residual), row-wise; fresh outputs.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                                                      double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm: weight shape");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  auto res_out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), sx = x.stride(0), sr = residual.stride(0);
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *op = out.data_ptr<float>(), *rop = res_out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* r = rop + i * n;
      const float *xi = xp + i * sx, *ri = rp + i * sr;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) r[j] = xi[j] + ri[j];
      normalize_row(r, wp, op + i * n, n, static_cast<float>(eps));
    }
  });
  return {out, res_out};
}

// x = [gate | up] per row -> silu(gate) * up, silu(g) = g / (1 + exp(-g)).
at::Tensor silu_and_mul(at::Tensor x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: odd width");
  const int64_t d = x.size(1) / 2, sx = x.stride(0);
  auto out = at::empty({x.size(0), d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float *g = xp + i * sx, *u = g + d;
      float* o = op + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) o[j] = g[j] / (1.f + std::exp(std::min(-g[j], kExpMax))) * u[j];
    }
  });
  return out;
}

namespace {

// Neox (rotate-half) rotary of the first `rot` dims of each head of one row, in place.
inline void rotate_row(float* x, int64_t heads, int64_t head_dim, int64_t rot, const float* cos, const float* sin) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* a = x + h * head_dim;
    float* b = a + half;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = a[j], x2 = b[j];
      a[j] = x1 * cos[j] - x2 * sin[j];
      b[j] = x2 * cos[j + half] + x1 * sin[j + half];
    }
  }
}

}  // namespace

// Rotated copies of q [n, hq*head_dim] and k [n, hkv*head_dim] (rows may be strided slices of a
// fused qkv); dims past `rot` in each head are copied. cos/sin: [max_position, rot] fp32 tables.
std::tuple<at::Tensor, at::Tensor> rotary(at::Tensor q, at::Tensor k, at::Tensor positions,
                                                at::Tensor cos, at::Tensor sin, int64_t head_dim, int64_t rot) {
  check_rows(q, "rotary");
  check_rows(k, "rotary");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "rotary: int64 positions, one per row");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.size(1) == rot && sin.size(1) == rot,
              "rotary: cos/sin tables");
  TORCH_CHECK(rot % 2 == 0 && rot <= head_dim && q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0 &&
                  k.size(0) == q.size(0), "rotary: dims");
  const int64_t n = q.size(0), wq = q.size(1), wk = k.size(1), max_pos = cos.size(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < max_pos, "rotary: position ", pp[i], " outside the table");
  auto q_out = at::empty({n, wq}, q.options());
  auto k_out = at::empty({n, wk}, k.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qo = q_out.data_ptr<float>(), *ko = k_out.data_ptr<float>();
  const int64_t sq = q.stride(0), sk = k.stride(0);
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float *c = cp + pp[i] * rot, *s = sp + pp[i] * rot;
      std::copy(qp + i * sq, qp + i * sq + wq, qo + i * wq);
      std::copy(kp + i * sk, kp + i * sk + wk, ko + i * wk);
      rotate_row(qo + i * wq, wq / head_dim, head_dim, rot, c, s);
      rotate_row(ko + i * wk, wk / head_dim, head_dim, rot, c, s);
    }
  });
  return {q_out, k_out};
}

namespace {

using bits32 = uint32_t __attribute__((__may_alias__));  // a float's bits, read in place

// NaN tests on the bits: -ffast-math lets the compiler assume x == x.
inline bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

}  // namespace

// Row-wise argmax of x [rows, cols] as torch.argmax(x, dim=-1): the first index of the largest
// value, a NaN counting as the largest.
at::Tensor argmax_rows(at::Tensor x) {
  check_rows(x, "argmax_rows");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: empty rows");
  const int64_t rows = x.size(0), cols = x.size(1), sx = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* r = xp + i * sx;
      const bits32* u = reinterpret_cast<const bits32*>(r);
      float best = r[0];
      uint32_t nans = 0;
#pragma omp simd reduction(max : best) reduction(| : nans)
      for (int64_t j = 0; j < cols; ++j) {
        best = std::max(best, r[j]);
        nans |= static_cast<uint32_t>(is_nan_bits(u[j]));
      }
      int64_t idx = 0;
      if (nans) {
        while (!is_nan_bits(u[idx])) ++idx;  // torch: the first NaN wins
      } else {
        // a row of -inf only (every token masked) may reduce to the max's identity (-FLT_MAX), which
        // no element equals: torch answers 0 there, and the search must not leave the row
        while (idx < cols && r[idx] != best) ++idx;
        if (idx == cols) idx = 0;
      }
      op[i] = idx;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over rows (fp32)");
  m.def("add_rms_norm", &add_rms_norm, "residual add then RMSNorm (fp32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (fp32)");
  m.def("argmax_rows", &argmax_rows, "row-wise argmax (fp32), torch.argmax semantics");
  m.def("rotary", &rotary, "neox rotary, rotated copies of q and k (fp32)");
}
