// Exact greedy decoding through an output projection, screened in bf16 (CPU, AVX-512).
//
// Why: for greedy rows only argmax_v(x . w_v) is needed, not the logits. A bf16 pass over the
// weight (half the bytes; vdpbf16ps where the CPU has AVX-512 BF16, else the weights widened to
// fp32 for fp32 FMAs) gives every logit to within a
// proven bound; only the few vocabulary rows whose interval can still hold the maximum are then
// computed in fp32. The answer is the fp32 argmax (first index of the largest fp32 logit), the
// same token the fp32 logits give up to their own rounding; no logit is approximated in it.
//
// The bound: bf16 rounding of x and w (unit roundoff u = 2^-8) moves each product by at most
// (2u + u^2) |x_k w_k|; fp32 accumulation of K terms adds at most gamma_K sum |x_k w_k| to the
// bf16 sum and to the fp32 logit each, and sum_k |x_k w_k| <= ||x|| ||w_v|| (Cauchy-Schwarz).
// Denormals flushed by vdpbf16ps change a sum by less than K * 2^-126 * max|.|: the absolute term.
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_panels.h"

#define RS_HAVE_BF16_SCREEN RS_HAVE_BF16_PANELS

namespace {

using rs_bf16::NR;  // vocabulary rows per panel
using rs_bf16::to_bf16;
constexpr double kUnitRoundoffBf16 = 1.0 / 256;
constexpr double kUnitRoundoffFp32 = 1.0 / (1 << 24);
constexpr float kAbsoluteSlack = 1e-30f;
constexpr float kRoundingSlack = 4.f / (1 << 24);

// -ffast-math lets the compiler assume finite values, so the checks look at the bits.
inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline bool finite_bits(float f) { return (bits(f) & 0x7f800000u) != 0x7f800000u; }
inline bool nan_bits(float f) { return (bits(f) & 0x7fffffffu) > 0x7f800000u; }

// The relative part of the bound for K-term dot products (see the top of the file), with 1% slack.
double relative_bound(int64_t K) {
  const double n = static_cast<double>(K + 2) * kUnitRoundoffFp32;
  const double gamma = n / (1.0 - n);
  const double u = kUnitRoundoffBf16;
  return 1.01 * ((2 * u + u * u) * (1 + gamma) + 2 * gamma);
}

// ||r|| in double, rounded up to the next float: the bound may only grow.
float norm_up(const float* r, int64_t n) {
  double ss = 0;
  for (int64_t j = 0; j < n; ++j) ss += static_cast<double>(r[j]) * r[j];
  return std::nextafter(static_cast<float>(std::sqrt(ss)), INFINITY);
}

float dot_fp32(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += a[j] * b[j];
  return acc;
}

// torch.argmax over the full fp32 logits of one row (the first NaN wins, else the first maximum).
int64_t exact_argmax(const float* x, const float* w, int64_t n, int64_t K) {
  int64_t best_i = 0;
  float best = -INFINITY;
  for (int64_t v = 0; v < n; ++v) {
    const float e = dot_fp32(x, w + v * K, K);
    if (nan_bits(e)) return v;
    if (v == 0 || e > best) best = e, best_i = v;
  }
  return best_i;
}

}  // namespace

bool available() { return RS_HAVE_BF16_SCREEN; }
bool dot_available() { return RS_HAVE_BF16_DOT; }

// w [N, K] fp32 -> (panels [ceil(N / 48), ceil(K / 2), 48, 2] bf16 as int16, norms [N] fp32):
// panel element (p, k2, j, e) = bf16(w[48 p + j, 2 k2 + e]), zero past the ends; norms rounded up.
std::tuple<at::Tensor, at::Tensor> pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "greedy_head.pack: fp32 [N, K]");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), K2 = (K + 1) / 2, np = (N + NR - 1) / NR;
  const float* wp = w.data_ptr<float>();
  for (int64_t i = 0; i < N * K; ++i) TORCH_CHECK(finite_bits(wp[i]), "greedy_head.pack: non-finite weight");
  auto panels = at::zeros({np, K2, NR, 2}, w.options().dtype(at::kShort));
  auto norms = at::empty({N}, w.options());
  auto* pp = reinterpret_cast<uint16_t*>(panels.data_ptr<int16_t>());
  float* np_ = norms.data_ptr<float>();
  at::parallel_for(0, np, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t j = 0; j < std::min(NR, N - p * NR); ++j) {
        const float* row = wp + (p * NR + j) * K;
        np_[p * NR + j] = norm_up(row, K);
        for (int64_t k = 0; k < K; ++k) pp[rs_bf16::panel_offset(p, K2, j, k)] = to_bf16(row[k]);
      }
  });
  return {panels, norms};
}

// For each row of x [M, K]: argmax over v < n of the fp32 logit x . w[v] (w [n, K] fp32, the
// weight `pack` saw), first index on ties; rows holding a non-finite value get torch.argmax's answer
// from a full fp32 pass. widen: the screen multiplies fp32 x by the widened bf16 weights (fp32 FMAs:
// the faster screen where vdpbf16ps is slow, gemm.cpp's dot_to_fma_rate) instead of bf16 x by
// vdpbf16ps; the bound above holds for both (x unrounded only removes a term). Returns int64 [M].
at::Tensor argmax(at::Tensor x, at::Tensor panels, at::Tensor norms, at::Tensor w, bool widen) {
  TORCH_CHECK(RS_HAVE_BF16_SCREEN, "greedy_head: built without AVX-512");
  TORCH_CHECK(widen || RS_HAVE_BF16_DOT, "greedy_head: a vdpbf16ps screen needs a build with AVX-512 BF16 (widen)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "greedy_head: x fp32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x.size(1),
              "greedy_head: w fp32 [n, K], contiguous");
  const int64_t M = x.size(0), K = x.size(1), K2 = (K + 1) / 2, n = w.size(0), np = (n + NR - 1) / NR;
  TORCH_CHECK(panels.dim() == 4 && panels.size(0) == np && panels.size(1) == K2 && panels.size(2) == NR &&
                  panels.size(3) == 2 && panels.is_contiguous() && panels.scalar_type() == at::kShort,
              "greedy_head: panels do not match w");
  TORCH_CHECK(norms.numel() == n && norms.is_contiguous() && norms.scalar_type() == at::kFloat,
              "greedy_head: norms do not match w");
  auto out = at::empty({M}, x.options().dtype(at::kLong));
#if RS_HAVE_BF16_SCREEN
  const float* xp = x.data_ptr<float>();
  const int64_t lda = x.stride(0);
  const float* wp = w.data_ptr<float>();
  const auto* pp = reinterpret_cast<const uint16_t*>(panels.data_ptr<int16_t>());
  const float* wn = norms.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // x as bf16 pairs, and which rows can be screened (all finite)
  std::vector<uint32_t> xb(widen ? 0 : static_cast<size_t>(M * K2));
  std::vector<float> xn(static_cast<size_t>(M));
  std::vector<char> finite(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * lda;
    bool ok = true;
    for (int64_t k = 0; k < K; ++k) ok = ok && finite_bits(r[k]);
    finite[m] = ok;
    xn[m] = ok ? norm_up(r, K) : 0.f;
#if RS_HAVE_BF16_DOT
    if (ok && !widen) rs_bf16::row_to_pairs(r, K, xb.data() + m * K2);
#endif
  }
  // approximate logits, panel by panel (each thread streams a contiguous run of panels)
  auto approx_t = at::empty({M, n}, x.options());
  float* approx = approx_t.data_ptr<float>();
  at::parallel_for(0, np, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      const uint16_t* panel = pp + p * K2 * NR * 2;
      const uint16_t* next = p + 1 < e ? panel + K2 * NR * 2 : nullptr;
#if RS_HAVE_BF16_DOT
      if (!widen) {
        rs_bf16::panel_product(rs_bf16::PairRows{xb.data(), K2}, M, panel, next, K, approx + p * NR, n,
                               std::min(NR, n - p * NR));
        continue;
      }
#endif
      rs_bf16::panel_product(rs_bf16::FloatRows{xp, lda}, M, panel, next, K, approx + p * NR, n, std::min(NR, n - p * NR));
    }
  });
  const float rel = static_cast<float>(relative_bound(K));
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float* xm = xp + m * lda;
      if (!finite[m]) {
        op[m] = exact_argmax(xm, wp, n, K);
        continue;
      }
      const float* a = approx + m * n;
      const float scale = rel * xn[m];
      // |a[v] - logit v| <= bound(v) = scale * ||w_v|| + |a[v]| * kRoundingSlack + kAbsoluteSlack
      // (the |a| term covers the rounding of a[v] -/+ bound itself), 16 vocabulary rows at a time
      const __m512 vscale = _mm512_set1_ps(scale), vround = _mm512_set1_ps(kRoundingSlack),
                   vabs = _mm512_set1_ps(kAbsoluteSlack);
      auto bound = [&](__m512 av, __m512 wv) {
        return _mm512_fmadd_ps(vscale, wv, _mm512_fmadd_ps(_mm512_abs_ps(av), vround, vabs));
      };
      auto tail = [&](int64_t v) { return v + 16 <= n ? __mmask16(0xffff) : __mmask16((1u << (n - v)) - 1); };
      __m512 vlower = _mm512_set1_ps(-INFINITY);  // the maximum logit is at least every a - bound
      for (int64_t v = 0; v < n; v += 16) {
        const __mmask16 k = tail(v);
        const __m512 av = _mm512_maskz_loadu_ps(k, a + v), wv = _mm512_maskz_loadu_ps(k, wn + v);
        vlower = _mm512_mask_max_ps(vlower, k, vlower, _mm512_sub_ps(av, bound(av, wv)));
      }
      const float lower = _mm512_reduce_max_ps(vlower);
      const __m512 vlow = _mm512_set1_ps(lower);
      int64_t best_i = -1;
      float best = 0.f;
      bool exact_ok = finite_bits(lower);
      for (int64_t v = 0; v < n && exact_ok; v += 16) {
        const __mmask16 k = tail(v);
        const __m512 av = _mm512_maskz_loadu_ps(k, a + v), wv = _mm512_maskz_loadu_ps(k, wn + v);
        // rows whose upper bound reaches `lower` can still be the maximum: compute them in fp32
        uint32_t cand = _mm512_mask_cmp_ps_mask(k, _mm512_add_ps(av, bound(av, wv)), vlow, _CMP_GE_OQ);
        for (; cand != 0 && exact_ok; cand &= cand - 1) {
          const int64_t c = v + __builtin_ctz(cand);
          const float logit = dot_fp32(xm, wp + c * K, K);
          exact_ok = finite_bits(logit);
          if (best_i < 0 || logit > best) best = logit, best_i = c;
        }
      }
      op[m] = exact_ok && best_i >= 0 ? best_i : exact_argmax(xm, wp, n, K);
    }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "built with AVX-512 (the screen widens bf16 weights at least)");
  m.def("dot_available", &dot_available, "built with AVX-512 BF16: the screen can also run on vdpbf16ps");
  m.def("pack", &pack, "bf16 panels and row norms of an fp32 [N, K] output projection");
  m.def("argmax", &argmax, "exact fp32 argmax of x @ w^T per row, screened by a bf16 pass", py::arg("x"),
        py::arg("panels"), py::arg("norms"), py::arg("w"), py::arg("widen") = false);
}
