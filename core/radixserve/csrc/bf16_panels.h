// bf16 column panels and their AVX-512 BF16 microkernel, shared by the GEMM (gemm.cpp, for
// runtime.cpu_matmul_precision=medium) and the greedy head's screen (greedy_head.cpp).
//
// Layout: a [N, K] weight becomes panels [ceil(N / 48), ceil(K / 2), 48, 2] of bf16 bits (int16
// tensors): element (p, k2, j, e) = bf16(w[48 p + j, 2 k2 + e]), zero past the ends. An x row is
// its bf16 values in order, zero-padded to an even length, read as 32-bit pairs: one vdpbf16ps
// multiplies a pair of x by the same pair of 16 columns and adds both products to an fp32 sum
// (twice the fp32 FMA rate on the same port, half the weight bytes).
// Only compiled where the CPU has AVX-512 BF16 (RS_HAVE_BF16_PANELS); the includer adds no other
// definitions of these names.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(RS_NO_AVX512)
#include <immintrin.h>
#define RS_HAVE_BF16_PANELS 1
#else
#define RS_HAVE_BF16_PANELS 0
#endif

namespace rs_bf16 {

constexpr int64_t NR = 48;      // columns per panel (3 vectors of 16 fp32 results)
constexpr int64_t MR = 8;       // x rows per microkernel call
constexpr int64_t KC2 = 1024;   // k pairs per block: a 1024 x 48 x 2 bf16 slice (192 KB) stays in L2

// Round to nearest even. NaN stays NaN (a payload only in the low half would otherwise round to inf).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Where weight element (row 48 p + j, column k) sits in the panels of a K-column weight (K2 = ceil(K / 2)).
inline int64_t panel_offset(int64_t p, int64_t K2, int64_t j, int64_t k) { return ((p * K2 + k / 2) * NR + j) * 2 + k % 2; }

#if RS_HAVE_BF16_PANELS
// x row [K] fp32 -> out [K2] bf16 pairs (K2 = ceil(K / 2)), round to nearest even.
inline void row_to_pairs(const float* x, int64_t K, uint32_t* out) {
  auto* o = reinterpret_cast<uint16_t*>(out);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + k));
    std::memcpy(o + k, &v, 32);
  }
  for (; k < K; ++k) o[k] = to_bf16(x[k]);
  if (K % 2) o[K] = 0;
}

// c[rows x 48] (+)= a[rows x K2 pairs] @ panel[K2 x 48 x 2]; rows <= 8; `cols` < 48: the last,
// partial panel; `next` (the following slice or panel) is prefetched into L2; `accumulate`: add to
// c (a later K block) instead of overwriting it.
template <int ROWS>
__attribute__((always_inline)) inline void micro(const uint32_t* a, int64_t lda, const uint16_t* panel, int64_t K2,
                                                 float* c, int64_t ldc, int64_t cols, const uint16_t* next,
                                                 bool accumulate, int64_t pf_first = 0, int64_t pf_step = 1) {
  const bool load = accumulate && cols == NR;
  __m512 acc[ROWS][3];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < 3; ++j) acc[r][j] = load ? _mm512_loadu_ps(c + r * ldc + 16 * j) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* p = panel + k * NR * 2;
    if (next != nullptr && k % pf_step == pf_first) {  // a k row is 192 bytes: three lines
      const char* q = reinterpret_cast<const char*>(next + k * NR * 2);
      _mm_prefetch(q, _MM_HINT_T1);
      _mm_prefetch(q + 64, _MM_HINT_T1);
      _mm_prefetch(q + 128, _MM_HINT_T1);
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(p), b1 = (__m512bh)_mm512_loadu_si512(p + 32),
                   b2 = (__m512bh)_mm512_loadu_si512(p + 64);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * lda + k]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], av, b2);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    if (cols == NR) {
      _mm512_storeu_ps(c + r * ldc, acc[r][0]);
      _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
      _mm512_storeu_ps(c + r * ldc + 32, acc[r][2]);
    } else {
      alignas(64) float tmp[NR];
      _mm512_store_ps(tmp, acc[r][0]);
      _mm512_store_ps(tmp + 16, acc[r][1]);
      _mm512_store_ps(tmp + 32, acc[r][2]);
      for (int64_t j = 0; j < cols; ++j) c[r * ldc + j] = accumulate ? c[r * ldc + j] + tmp[j] : tmp[j];
    }
  }
}

// c[rows x cols] = a[rows x K2 pairs] @ one panel [K2 x 48 x 2], K block by K block (each slice stays
// in L2 while every row group uses it); the first rows' pass prefetches the slice after it, or
// `next_panel`.
inline void panel_product(const uint32_t* a, int64_t lda, int64_t rows, const uint16_t* panel,
                          const uint16_t* next_panel, int64_t K2, float* c, int64_t ldc, int64_t cols) {
  for (int64_t k0 = 0; k0 < K2; k0 += KC2) {
    const int64_t kc = std::min(KC2, K2 - k0);
    const uint16_t* slice = panel + k0 * NR * 2;
    const uint16_t* next = k0 + KC2 < K2 ? slice + kc * NR * 2 : next_panel;
    const uint32_t* ak = a + k0;
    const bool acc = k0 > 0;
    // the next slice's prefetch is spread over the first two row groups (a decode batch of 9-16 rows:
    // each asks DRAM for half, so the requests are spread over both passes)
    const int64_t pf_step = rows > MR && rows <= 2 * MR ? 2 : 1;
    int64_t m = 0;
    for (; m + MR <= rows; m += MR)
      micro<MR>(ak + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, m < pf_step * MR ? next : nullptr, acc, m / MR,
                pf_step);
    const uint16_t* nx = m < pf_step * MR ? next : nullptr;
    const int64_t pf_first = m / MR;
    switch (rows - m) {  // the remainder rows, fewer than MR
      case 7: micro<7>(ak + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 6: micro<6>(ak + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 5: micro<5>(ak + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 4: micro<4>(ak + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 3: micro<3>(ak + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 2: micro<2>(ak + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 1: micro<1>(ak + m * lda, lda, slice, kc, c + m * ldc, ldc, cols, nx, acc, pf_first, pf_step); break;
      default: break;
    }
  }
}
#endif

}  // namespace rs_bf16
