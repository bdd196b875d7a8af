// fp32 GEMM for batched CPU decode: y[M, N] = x[M, K] @ w[N, K]^T, w packed once into column panels.
//
// Why: at decode batch sizes (tens of rows) every step streams all weights from DRAM once; the
// library GEMMs lose about a third of their in-cache rate to that. Here each thread walks its
// panels in memory order and prefetches the next panel while the current one is in use, so the
// FMA units keep fed. Microkernel: 8 rows x 48 columns (24 AVX-512 accumulators) where the CPU has
// AVX-512, else 4 rows x 24 columns (12 AVX2 accumulators); the panel width follows, so packed
// weights belong to the build that packed them. RS_NO_AVX512 forces the AVX2 kernel (tests).
// Panels converted to bf16 (`to_bf16_panels`, for runtime.cpu_matmul_precision=medium) take the same
// paths, products summed in fp32: x rounded to bf16 once per call for vdpbf16ps (AVX-512 BF16), or
// x fp32 and the weights widened to fp32 (in the AVX-512 microkernel, bf16_panels.h; AVX2: a K block
// at a time into L1, for the fp32 microkernel).
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
#include <atomic>
#include <chrono>
#include <cmath>
#include <vector>

#include "bf16_panels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RS_HAVE_AVX2 1
#else
#define RS_HAVE_AVX2 0
#endif
#if RS_HAVE_AVX2 && defined(__AVX512F__) && !defined(RS_NO_AVX512)
#define RS_HAVE_AVX512 1
#else
#define RS_HAVE_AVX512 0
#endif
// bf16 panels in this build: every build with a kernel has them. AVX-512 multiplies them in its
// microkernels (bf16_panels.h); the AVX2 kernel widens each K block of a panel to fp32 once, into
// L1, and runs its fp32 microkernel there
#define RS_GEMM_BF16 RS_HAVE_AVX2

namespace {

// silu(g) = g / (1 + exp(-g)); the exponent is capped below fp32 overflow because -ffast-math
// assumes finite values (exp(-g) = inf would give NaN); at the cap silu(g) is already ~0.
constexpr float kExpMax = 88.f;

constexpr int64_t kL2Budget = 384 * 1024;  // bytes of x rows kept in L2 per row chunk
#if RS_HAVE_AVX512
constexpr int64_t NR = 48;  // panel width (3 AVX-512 vectors)
constexpr int64_t MR = 8;   // rows per microkernel call
// K block: in practice none. A whole K x 48 panel (110 KB at K = 576) stays in L2 (1 MB per core on
// the AVX-512 parts seen) while every row group uses it; on Zen 4 that measured ~5% faster than
// L1-sized blocks, which reload and re-store the accumulators once per block.
constexpr int64_t KC = 2048;
#else
constexpr int64_t NR = 24;  // panel width (3 AVX2 vectors)
constexpr int64_t MR = 4;   // rows per microkernel call
constexpr int64_t KC = 192;  // K block: a 192 x 24 panel slice (18 KB) stays in L1 while all rows use it
#endif

#if RS_HAVE_AVX512
// c[rows x 48] (+)= a[rows x K] @ panel[K x 48]; rows <= 8. `next`, `accumulate`: as in the AVX2
// kernel below. With 32 vector registers the accumulator array stays in registers once unrolled.
template <int ROWS>
__attribute__((always_inline)) inline void micro(const float* a, int64_t lda, const float* panel, int64_t K, float* c,
                                                 int64_t ldc, int64_t cols, const float* next, bool accumulate) {
  __m512 acc[ROWS][3];
  rs_bf16::tile_start<ROWS>(acc, c, ldc, accumulate && cols == NR);
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * NR;
    if (next != nullptr) {  // a k row is 192 bytes: three lines
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NR), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NR + 16), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NR + 32), _MM_HINT_T1);
    }
    const __m512 b0 = _mm512_loadu_ps(p), b1 = _mm512_loadu_ps(p + 16), b2 = _mm512_loadu_ps(p + 32);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + k]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2]);
    }
  }
  rs_bf16::tile_store<ROWS>(acc, c, ldc, cols, accumulate);
}
#elif RS_HAVE_AVX2
// c[rows x 24] (+)= a[rows x K] @ panel[K x 24]; rows <= 4. `next` is prefetched (the following
// panel slice); accumulate: add to c (a later K block) instead of overwriting it (the first).
// The accumulators are named registers, not an array: GCC spills arrays of vectors.
template <int ROWS>
__attribute__((always_inline)) inline void micro(const float* a, int64_t lda, const float* panel, int64_t K, float* c,
                                                 int64_t ldc, int64_t cols, const float* next, bool accumulate) {
  const bool load = accumulate && cols == NR;  // a partial panel adds its earlier blocks at the store
  auto start = [&](int r, int j) {
    return r < ROWS && load ? _mm256_loadu_ps(c + r * ldc + 8 * j) : _mm256_setzero_ps();
  };
  __m256 r0a = start(0, 0), r0b = start(0, 1), r0c = start(0, 2);
  __m256 r1a = start(1, 0), r1b = start(1, 1), r1c = start(1, 2);
  __m256 r2a = start(2, 0), r2b = start(2, 1), r2c = start(2, 2);
  __m256 r3a = start(3, 0), r3b = start(3, 1), r3c = start(3, 2);
  const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda;
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * NR;
    if (next != nullptr) {  // a k row is 96 bytes: two prefetches 64 bytes apart cover every line
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NR), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NR + 16), _MM_HINT_T1);
    }
    __m256 b0 = _mm256_loadu_ps(p), b1 = _mm256_loadu_ps(p + 8), b2 = _mm256_loadu_ps(p + 16);
    // keep the panel vectors in registers: folded into each FMA they would be loaded once per row,
    // and the load ports, not the FMA units, would bound the loop
    __asm__("" : "+x"(b0), "+x"(b1), "+x"(b2));
    __m256 av = _mm256_broadcast_ss(a0 + k);
    r0a = _mm256_fmadd_ps(av, b0, r0a);
    r0b = _mm256_fmadd_ps(av, b1, r0b);
    r0c = _mm256_fmadd_ps(av, b2, r0c);
    if constexpr (ROWS > 1) {
      av = _mm256_broadcast_ss(a1 + k);
      r1a = _mm256_fmadd_ps(av, b0, r1a);
      r1b = _mm256_fmadd_ps(av, b1, r1b);
      r1c = _mm256_fmadd_ps(av, b2, r1c);
    }
    if constexpr (ROWS > 2) {
      av = _mm256_broadcast_ss(a2 + k);
      r2a = _mm256_fmadd_ps(av, b0, r2a);
      r2b = _mm256_fmadd_ps(av, b1, r2b);
      r2c = _mm256_fmadd_ps(av, b2, r2c);
    }
    if constexpr (ROWS > 3) {
      av = _mm256_broadcast_ss(a3 + k);
      r3a = _mm256_fmadd_ps(av, b0, r3a);
      r3b = _mm256_fmadd_ps(av, b1, r3b);
      r3c = _mm256_fmadd_ps(av, b2, r3c);
    }
  }
  const __m256 out[4][3] = {{r0a, r0b, r0c}, {r1a, r1b, r1c}, {r2a, r2b, r2c}, {r3a, r3b, r3c}};
  for (int r = 0; r < ROWS; ++r) {
    if (cols == NR) {
      _mm256_storeu_ps(c + r * ldc, out[r][0]);
      _mm256_storeu_ps(c + r * ldc + 8, out[r][1]);
      _mm256_storeu_ps(c + r * ldc + 16, out[r][2]);
    } else {  // the last, partial panel
      alignas(32) float tmp[NR];
      _mm256_store_ps(tmp, out[r][0]);
      _mm256_store_ps(tmp + 8, out[r][1]);
      _mm256_store_ps(tmp + 16, out[r][2]);
      for (int64_t j = 0; j < cols; ++j) c[r * ldc + j] = accumulate ? c[r * ldc + j] + tmp[j] : tmp[j];
    }
  }
}
#endif

#if RS_HAVE_AVX2
// c[rows x NR] = x[rows x K] @ one panel [K x NR], K block by K block (each KC x NR slice stays in
// cache while every row uses it); the first rows' pass prefetches the slice after it, or `next_panel`.
inline void panel_product(const float* x, int64_t lda, int64_t rows, const float* panel, const float* next_panel,
                          int64_t K, float* c, int64_t ldc, int64_t cols) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    const float* slice = panel + k0 * NR;
    const float* next = k0 + KC < K ? slice + kc * NR : next_panel;
    const float* xk = x + k0;
    const bool acc = k0 > 0;
    int64_t m = 0;
    for (; m + MR <= rows; m += MR)
      micro<MR>(xk + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, m == 0 ? next : nullptr, acc);
    const float* nx = m == 0 ? next : nullptr;
    switch (rows - m) {  // the remainder rows, fewer than MR
#if RS_HAVE_AVX512
      case 7: micro<7>(xk + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc); break;
      case 6: micro<6>(xk + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc); break;
      case 5: micro<5>(xk + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc); break;
      case 4: micro<4>(xk + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc); break;
#endif
      case 3: micro<3>(xk + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc); break;
      case 2: micro<2>(xk + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc); break;
      case 1: micro<1>(xk + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc); break;
      default: break;
    }
  }
}
#endif

// body(t) for every task t in [0, n), each thread taking the next task as it finishes one. Why not
// at::parallel_for's one contiguous share per thread: a served step shares the cores with the HTTP
// front end, the detokenizer and clients, and when the OS gives one thread's core away mid-GEMM the
// static split waits for it at the region's end; here the other thread takes over its remaining tasks.
template <class Body>
void for_tasks(int64_t n, const Body& body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < n; t = next.fetch_add(1, std::memory_order_relaxed))
      body(t);
  });
}

// Units per run: about four runs per thread, so a thread that lost its core leaves at most a
// quarter of its share for the other to take over.
int64_t run_length(int64_t n) { return std::max<int64_t>(1, n / (4 * at::get_num_threads())); }

// Rows per chunk: a chunk's x rows (K values of `bytes` each as the product reads them: fp32, or
// bf16 pairs) stay in L2 while a thread streams its panels past them (all of a decode batch is one
// chunk); each chunk streams every panel once more.
int64_t rows_per_chunk(int64_t K, int64_t bytes) { return std::max<int64_t>(MR, (kL2Budget / (K * bytes)) / MR * MR); }

bool is_bf16(const at::Tensor& panels) { return panels.scalar_type() == at::kShort; }

// x fp32 [M, K] with contiguous rows, and `num_panels` packed panels for it: fp32 [K, NR] each, or
// bf16 [ceil(K / 2), NR, 2] each; vdpbf16ps (not `widen`) only where the build has it.
void check_operands(const at::Tensor& x, const at::Tensor& panels, int64_t num_panels, bool widen) {
  TORCH_CHECK(RS_HAVE_AVX2, "gemm: built without AVX2/FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "gemm: x fp32 [M, K]");
  TORCH_CHECK(panels.is_contiguous() && panels.size(0) == num_panels, "gemm: panels do not match the output width");
  if (is_bf16(panels)) {
    TORCH_CHECK(RS_GEMM_BF16, "gemm: bf16 panels need a build with AVX2");
    TORCH_CHECK(widen || RS_HAVE_BF16_DOT, "gemm: vdpbf16ps products need a build with AVX-512 BF16 (widen them)");
    TORCH_CHECK(panels.dim() == 4 && panels.size(1) == (x.size(1) + 1) / 2 && panels.size(2) == NR &&
                    panels.size(3) == 2, "gemm: bf16 panels do not match x");
  } else {
    TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.size(1) == x.size(1) &&
                    panels.size(2) == NR, "gemm: panels do not match x");
  }
}

// One GEMM's operands in one precision: product(m, rows, p, next, c, ldc, cols) computes
// c[rows x cols] = x[m : m + rows] @ panel p, prefetching panel p + 1 when `next`.
#if RS_HAVE_AVX2
struct Fp32Operands {
  static constexpr int64_t kBytes = 4;  // an x value as the product reads it
  const float* x;
  int64_t lda, K;
  const float* panels;
  Fp32Operands(const at::Tensor& xt, const at::Tensor& pt)
      : x(xt.data_ptr<float>()), lda(xt.stride(0)), K(xt.size(1)), panels(pt.data_ptr<float>()) {}
  void product(int64_t m, int64_t rows, int64_t p, bool next, float* c, int64_t ldc, int64_t cols) const {
    const float* panel = panels + p * K * NR;
    panel_product(x + m * lda, lda, rows, panel, next ? panel + K * NR : nullptr, K, c, ldc, cols);
  }
};
#endif

#if RS_HAVE_BF16_PANELS
static_assert(NR == rs_bf16::NR && MR == rs_bf16::MR, "bf16 panels share the fp32 panel width");
#endif
#if RS_HAVE_BF16_DOT
struct Bf16Operands {
  static constexpr int64_t kBytes = 2;  // an x value as the product reads it
  at::Tensor pairs;  // x as bf16 pairs [M, K2], made once per call
  const uint32_t* x;
  int64_t K, K2;
  const uint16_t* panels;
  Bf16Operands(const at::Tensor& xt, const at::Tensor& pt) : K(xt.size(1)), K2((xt.size(1) + 1) / 2) {
    const int64_t M = xt.size(0), lda = xt.stride(0);
    pairs = at::empty({M, K2}, xt.options().dtype(at::kInt));
    auto* out = reinterpret_cast<uint32_t*>(pairs.data_ptr<int32_t>());
    const float* xp = xt.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m) rs_bf16::row_to_pairs(xp + m * lda, K, out + m * K2);
    });
    x = out;
    panels = reinterpret_cast<const uint16_t*>(pt.data_ptr<int16_t>());
  }
  void product(int64_t m, int64_t rows, int64_t p, bool next, float* c, int64_t ldc, int64_t cols) const {
    const uint16_t* panel = panels + p * K2 * NR * 2;
    rs_bf16::panel_product(rs_bf16::PairRows{x + m * K2, K2}, rows, panel, next ? panel + K2 * NR * 2 : nullptr, K,
                           c, ldc, cols);
  }
};
#endif

#if RS_HAVE_BF16_PANELS
// bf16 panels with x as it is (fp32): the weights widened to fp32 in the product (rs_bf16::micro_widen)
struct Bf16WidenOperands {
  static constexpr int64_t kBytes = 4;
  const float* x;
  int64_t lda, K, K2;
  const uint16_t* panels;
  Bf16WidenOperands(const at::Tensor& xt, const at::Tensor& pt)
      : x(xt.data_ptr<float>()), lda(xt.stride(0)), K(xt.size(1)), K2((xt.size(1) + 1) / 2),
        panels(reinterpret_cast<const uint16_t*>(pt.data_ptr<int16_t>())) {}
  void product(int64_t m, int64_t rows, int64_t p, bool next, float* c, int64_t ldc, int64_t cols) const {
    const uint16_t* panel = panels + p * K2 * NR * 2;
    rs_bf16::panel_product(rs_bf16::FloatRows{x + m * lda, lda}, rows, panel, next ? panel + K2 * NR * 2 : nullptr, K,
                           c, ldc, cols);
  }
};
#endif

#if RS_HAVE_AVX2 && !RS_HAVE_AVX512
// AVX2 builds: bf16 panels [K2, NR, 2] widened a K block (KC values: 18 KB of fp32) at a time into a
// per-thread scratch that stays in L1, which the fp32 microkernel then reads for every row group of
// the call; the K block's widening prefetches the next block's (or panel's) bf16 lines into L2.
struct Bf16ScratchOperands {
  static constexpr int64_t kBytes = 4;
  static_assert(KC % 2 == 0, "a K block holds whole bf16 pairs");
  const float* x;
  int64_t lda, K, K2;
  const uint16_t* panels;
  Bf16ScratchOperands(const at::Tensor& xt, const at::Tensor& pt)
      : x(xt.data_ptr<float>()), lda(xt.stride(0)), K(xt.size(1)), K2((xt.size(1) + 1) / 2),
        panels(reinterpret_cast<const uint16_t*>(pt.data_ptr<int16_t>())) {}

  // rows [2 k2, 2 k2 + 1] of `pairs` pair rows (48 bf16 each) as fp32 rows of NR (even k: the low
  // halves shifted up; odd k: the high halves masked); `next`'s lines prefetched along
  static void widen(const uint16_t* pairs, int64_t n_pairs, const uint16_t* next, float* out) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t i = 0; i < n_pairs; ++i) {
      const uint16_t* q = pairs + i * NR * 2;
      if (next != nullptr) {  // a pair row is 96 bytes: two prefetches 64 bytes apart cover it
        _mm_prefetch(reinterpret_cast<const char*>(next + i * NR * 2), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next + i * NR * 2) + 64, _MM_HINT_T1);
      }
      float* even = out + 2 * i * NR;
      for (int64_t j = 0; j < NR; j += 8) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * j));
        _mm256_storeu_ps(even + j, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        _mm256_storeu_ps(even + NR + j, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
      }
    }
  }

  void product(int64_t m, int64_t rows, int64_t p, bool next, float* c, int64_t ldc, int64_t cols) const {
    thread_local std::vector<float> scratch;  // one K block of the panel in fp32 [KC, NR]
    scratch.resize(static_cast<size_t>(KC * NR));
    const uint16_t* panel = panels + p * K2 * NR * 2;
    const float* xm = x + m * lda;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0), pairs = (kc + 1) / 2;
      const uint16_t* slice = panel + (k0 / 2) * NR * 2;
      const uint16_t* following = k0 + KC < K ? slice + pairs * NR * 2 : next ? panel + K2 * NR * 2 : nullptr;
      widen(slice, pairs, following, scratch.data());  // an odd K's last row (zeros) is written, never read
      const bool acc = k0 > 0;
      int64_t r = 0;
      for (; r + MR <= rows; r += MR)
        micro<MR>(xm + r * lda + k0, lda, scratch.data(), kc, c + r * ldc, ldc, cols, nullptr, acc);
      float* cr = c + r * ldc;
      const float* xr = xm + r * lda + k0;
      switch (rows - r) {  // the remainder rows, fewer than MR (4)
        case 3: micro<3>(xr, lda, scratch.data(), kc, cr, ldc, cols, nullptr, acc); break;
        case 2: micro<2>(xr, lda, scratch.data(), kc, cr, ldc, cols, nullptr, acc); break;
        case 1: micro<1>(xr, lda, scratch.data(), kc, cr, ldc, cols, nullptr, acc); break;
        default: break;
      }
    }
  }
};
#endif

// body(operands of x and panels in the panels' precision; bf16 panels: `widen` picks widened weights
// over vdpbf16ps); nothing without AVX2 (check_operands refused).
template <class Body>
void with_operands(const at::Tensor& x, const at::Tensor& panels, bool widen, const Body& body) {
#if RS_HAVE_BF16_DOT
  if (is_bf16(panels) && !widen) return body(Bf16Operands(x, panels));
#endif
#if RS_HAVE_BF16_PANELS
  if (is_bf16(panels)) return body(Bf16WidenOperands(x, panels));
#elif RS_HAVE_AVX2
  if (is_bf16(panels)) return body(Bf16ScratchOperands(x, panels));
#endif
#if RS_HAVE_AVX2
  body(Fp32Operands(x, panels));
#endif
}

// body(m_begin, rows, b, e) for every row chunk of M and every run [b, e) of its `units` panels (or
// panel pairs; a run of several panels streams its weights in memory order, each prefetching the
// next), in one parallel region: the threads take (chunk, run) tasks in chunk order, so a chunk's x
// rows stay in L2 while both threads stream its panels, and the region ends once, at the last chunk
// (a region per chunk waited for the slower thread at every chunk's end: ~5% of a 512-row prefill
// step's time in libgomp).
template <class Body>
void for_chunk_runs(int64_t M, int64_t mc, int64_t units, const Body& body) {
  const int64_t run = run_length(units), runs = (units + run - 1) / run, chunks = (M + mc - 1) / mc;
  for_tasks(chunks * runs, [&](int64_t t) {
    const int64_t m_begin = (t / runs) * mc, b = (t % runs) * run;
    body(m_begin, std::min(M, m_begin + mc) - m_begin, b, std::min(units, b + run));
  });
}

// y [M, n] = x @ w^T; within a row chunk each thread takes runs of panels: its weights stream in
// memory order.
template <class Operands>
void linear_into(const Operands& ops, int64_t M, int64_t K, int64_t n, int64_t np, float* y) {
  for_chunk_runs(M, rows_per_chunk(K, Operands::kBytes), np, [&](int64_t m_begin, int64_t rows, int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      ops.product(m_begin, rows, p, p + 1 < e, y + m_begin * n + p * NR, n, std::min(NR, n - p * NR));
  });
}

// y [M, i] = silu(x @ gate^T) * (x @ up^T) over `pairs` (gate, up) panel pairs. Each pair is
// computed into a per-thread scratch and activated while it is in L1, so the [M, 2I]
// pre-activation never goes to memory.
template <class Operands>
void silu_mul_into(const Operands& ops, int64_t M, int64_t K, int64_t i, int64_t pairs, float* y) {
  for_chunk_runs(M, rows_per_chunk(K, Operands::kBytes), pairs, [&](int64_t m_begin, int64_t rows, int64_t b, int64_t e) {
    thread_local std::vector<float> scratch;  // [gate | up] tiles, ld = 2 * NR (one per thread, kept)
    scratch.resize(static_cast<size_t>(2 * rows * NR));
    for (int64_t q = b; q < e; ++q) {
      for (int64_t p = 2 * q; p < 2 * q + 2; ++p)  // gate, then up, into their halves of the scratch
        ops.product(m_begin, rows, p, p + 1 < 2 * e, scratch.data() + (p - 2 * q) * NR, 2 * NR, NR);
      const int64_t cols = std::min(NR, i - q * NR);
      for (int64_t r = 0; r < rows; ++r) {
        const float* g = scratch.data() + r * 2 * NR;
        const float* u = g + NR;
        float* o = y + (m_begin + r) * i + q * NR;
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) o[j] = g[j] / (1.f + std::exp(std::min(-g[j], kExpMax))) * u[j];
      }
    }
  });
}

}  // namespace

// vdpbf16ps's FLOP rate over the fp32 FMA's on this core, measured: 24 independent chains of each
// instruction kind (no memory), best of five alternating rounds of ~0.1 ms. Zen 4: ~2 (vdpbf16ps
// issues as fast as an FMA and does twice the work); Sapphire / Emerald Rapids: ~0.5. 0 where the
// build has no AVX-512 BF16 (bf16 panels, if any, are widened).
double dot_to_fma_rate() {
#if RS_HAVE_BF16_DOT
  auto time_ns = [](auto step) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  };
  constexpr int kChains = 24, kIters = 2000;
  float sink = 0.f;
  double dot_ns = 1e30, fma_ns = 1e30;
  for (int round = 0; round < 5; ++round) {
    dot_ns = std::min(dot_ns, time_ns([&] {
      __m512 acc[kChains];
      for (auto& v : acc) v = _mm512_setzero_ps();
      __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
      for (int i = 0; i < kIters; ++i) {
#pragma GCC unroll 24
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, a);
        __asm__("" : "+v"(a));
      }
      for (auto& v : acc) sink += _mm512_reduce_add_ps(v);
    }));
    fma_ns = std::min(fma_ns, time_ns([&] {
      __m512 acc[kChains];
      for (auto& v : acc) v = _mm512_setzero_ps();
      __m512 a = _mm512_set1_ps(1.f);
      for (int i = 0; i < kIters; ++i) {
#pragma GCC unroll 24
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(a, a, acc[c]);
        __asm__("" : "+v"(a));
      }
      for (auto& v : acc) sink += _mm512_reduce_add_ps(v);
    }));
  }
  __asm__ volatile("" : : "x"(sink));
  return 2.0 * fma_ns / dot_ns;  // a vdpbf16ps does twice an FMA's FLOPs
#else
  return 0.0;
#endif
}

bool available() { return RS_HAVE_AVX2; }
bool bf16_available() { return RS_GEMM_BF16; }
bool bf16_dot_available() { return RS_HAVE_BF16_DOT; }

// w [N, K] -> panels [ceil(N / NR), K, NR] (zero-padded columns).
at::Tensor pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack: fp32 [N, K]");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + NR - 1) / NR;
  auto out = at::zeros({panels, K, NR}, w.options());
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t j = 0; j < std::min(NR, N - p * NR); ++j)
        for (int64_t k = 0; k < K; ++k) op[(p * K + k) * NR + j] = wp[(p * NR + j) * K + k];
  });
  return out;
}

// fp32 panels [P, K, NR] (from `pack` or `pack_gated`) -> bf16 panels [P, ceil(K / 2), NR, 2] as int16
// (bf16_panels.h), rounded to nearest even; same panel order, so a gated packing stays gated.
at::Tensor to_bf16_panels(at::Tensor panels) {
  TORCH_CHECK(RS_GEMM_BF16, "to_bf16_panels: needs a build with AVX2");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.size(2) == NR && panels.is_contiguous(),
              "to_bf16_panels: fp32 panels [P, K, NR]");
  const int64_t P = panels.size(0), K = panels.size(1), K2 = (K + 1) / 2;
  auto out = at::zeros({P, K2, NR, 2}, panels.options().dtype(at::kShort));
  const float* src = panels.data_ptr<float>();
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>());
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < NR; ++j)
          dst[rs_bf16::panel_offset(p, K2, j, k, NR)] = rs_bf16::to_bf16(src[(p * K + k) * NR + j]);
  });
  return out;
}

// x [M, K] (rows contiguous), panels from `pack` (or `to_bf16_panels` of it), n = the unpadded N;
// widen: bf16 panels multiply fp32 x with widened weights instead of vdpbf16ps. Returns [M, n] fp32.
at::Tensor linear(at::Tensor x, at::Tensor panels, int64_t n, bool widen) {
  const int64_t np = (n + NR - 1) / NR;
  check_operands(x, panels, np, widen);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n}, x.options());
  with_operands(x, panels, widen, [&](const auto& ops) { linear_into(ops, M, K, n, np, y.data_ptr<float>()); });
  return y;
}

// w [2I, K] = [gate; up] -> panels [2 * ceil(I / NR), K, NR] ordered gate 0, up 0, gate 1, up 1, ...:
// the thread that owns a column range computes both halves of it (for `linear_silu_mul`).
at::Tensor pack_gated(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % 2 == 0, "pack_gated: [2I, K] weight");
  const int64_t half = w.size(0) / 2;
  auto gate = pack(w.narrow(0, 0, half)), up = pack(w.narrow(0, half, half));
  return at::stack({gate, up}, 1).reshape({-1, w.size(1), NR});
}

// silu(x @ gate^T) * (x @ up^T) from `pack_gated` panels (or `to_bf16_panels` of them); i = the
// unpadded I; widen as in `linear`. Returns [M, i] fp32.
at::Tensor linear_silu_mul(at::Tensor x, at::Tensor panels, int64_t i, bool widen) {
  const int64_t pairs = (i + NR - 1) / NR;
  check_operands(x, panels, 2 * pairs, widen);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, i}, x.options());
  with_operands(x, panels, widen, [&](const auto& ops) { silu_mul_into(ops, M, K, i, pairs, y.data_ptr<float>()); });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "built with AVX2 + FMA");
  m.def("panel_width", [] { return NR; }, "columns per packed panel (48 with AVX-512, else 24)");
  m.def("bf16_available", &bf16_available, "built with AVX2: bf16 panels can be used (widened at least)");
  m.def("bf16_dot_available", &bf16_dot_available, "built with AVX-512 BF16: bf16 panels can also run on vdpbf16ps");
  m.def("pack", &pack, "pack a [N, K] weight into NR-column panels");
  m.def("to_bf16_panels", &to_bf16_panels, "fp32 panels -> bf16 panels (runtime.cpu_matmul_precision=medium)");
  m.def("linear", &linear, "x @ w^T from packed panels", py::arg("x"), py::arg("panels"), py::arg("n"),
        py::arg("widen") = false);
  m.def("pack_gated", &pack_gated, "pack a [gate; up] weight into interleaved panel pairs");
  m.def("linear_silu_mul", &linear_silu_mul, "silu(x @ gate^T) * (x @ up^T) from pack_gated panels", py::arg("x"),
        py::arg("panels"), py::arg("i"), py::arg("widen") = false);
  m.def("dot_to_fma_rate", &dot_to_fma_rate, "vdpbf16ps FLOP rate over the fp32 FMA rate on this core (0: no BF16)");
}
