// bf16 column panels and their AVX-512 microkernels, shared by the GEMM (gemm.cpp, for
// runtime.cpu_matmul_precision=medium) and the greedy head's screen (greedy_head.cpp).
//
// Layout: a [N, K] weight becomes panels [ceil(N / 48), ceil(K / 2), 48, 2] of bf16 bits (int16
// tensors): element (p, k2, j, e) = bf16(w[48 p + j, 2 k2 + e]), zero past the ends. Two products:
// `micro` reads an x row as its bf16 values in order, zero-padded to an even length, as 32-bit
// pairs: one vdpbf16ps multiplies a pair of x by the same pair of 16 columns and adds both products
// to an fp32 sum (on Zen 4 twice the fp32 FMA rate on the same port; half the weight bytes);
// `micro_widen` keeps x fp32 and widens the weights (where vdpbf16ps is the slower instruction, or
// missing). The panels and `micro_widen` need AVX-512F only (RS_HAVE_BF16_PANELS, with the fp32 tile
// helpers: RS_HAVE_AVX512_TILES); `micro` and the bf16 x pairs it reads need AVX-512 BF16 too
// (RS_HAVE_BF16_DOT: Zen 4, Sapphire Rapids and later; an Ice Lake has the panels, not the dot).
// The includer adds no other definitions of these names.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && !defined(RS_NO_AVX512)
#include <immintrin.h>
#define RS_HAVE_AVX512_TILES 1  // tile_start / tile_store below
#else
#define RS_HAVE_AVX512_TILES 0
#endif
#define RS_HAVE_BF16_PANELS RS_HAVE_AVX512_TILES
#if RS_HAVE_BF16_PANELS && defined(__AVX512BF16__)
#define RS_HAVE_BF16_DOT 1  // vdpbf16ps: `micro`, `row_to_pairs`, `PairRows`
#else
#define RS_HAVE_BF16_DOT 0
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

// Where weight element (row nr p + j, column k) sits in the panels of a K-column weight (K2 = ceil(K / 2)),
// panels nr columns wide (48 here; gemm.cpp's AVX2 build packs 24-column bf16 panels the same way).
inline int64_t panel_offset(int64_t p, int64_t K2, int64_t j, int64_t k, int64_t nr = NR) {
  return ((p * K2 + k / 2) * nr + j) * 2 + k % 2;
}

#if RS_HAVE_AVX512_TILES
// A microkernel's [ROWS x 48] fp32 tile of c in 3 vectors a row (the AVX-512 kernels here and gemm.cpp's fp32
// one): `tile_start` loads it to accumulate into (a later K block of a full panel) or zeroes it; `tile_store`
// writes it back, `cols` < 48 being the last, partial panel (added to c where `accumulate`).
template <int ROWS>
__attribute__((always_inline)) inline void tile_start(__m512 (&acc)[ROWS][3], const float* c, int64_t ldc, bool load) {
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < 3; ++j) acc[r][j] = load ? _mm512_loadu_ps(c + r * ldc + 16 * j) : _mm512_setzero_ps();
}

template <int ROWS>
__attribute__((always_inline)) inline void tile_store(const __m512 (&acc)[ROWS][3], float* c, int64_t ldc, int64_t cols,
                                                      bool accumulate) {
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
#endif

#if RS_HAVE_BF16_PANELS
// One k pair of a panel (48 columns x 2 bf16: 192 bytes, three lines) into L2, ahead of its use.
__attribute__((always_inline)) inline void prefetch_pair_row(const uint16_t* row) {
  const char* q = reinterpret_cast<const char*>(row);
  _mm_prefetch(q, _MM_HINT_T1);
  _mm_prefetch(q + 64, _MM_HINT_T1);
  _mm_prefetch(q + 128, _MM_HINT_T1);
}

#if RS_HAVE_BF16_DOT
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
  __m512 acc[ROWS][3];
  tile_start<ROWS>(acc, c, ldc, accumulate && cols == NR);
  for (int64_t k = 0; k < K2; ++k) {
    const uint16_t* p = panel + k * NR * 2;
    if (next != nullptr && k % pf_step == pf_first) prefetch_pair_row(next + k * NR * 2);
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
  tile_store<ROWS>(acc, c, ldc, cols, accumulate);
}
#endif  // RS_HAVE_BF16_DOT

// The same product with fp32 x rows (a[r * lda + k], K values; no rounding of x) and the panel's bf16
// values widened to fp32 (exact: a bf16 is the high half of an fp32), summed with fp32 FMAs. Why: on
// CPUs where vdpbf16ps issues at a quarter of the fp32 FMA rate (Intel Sapphire / Emerald Rapids
// measured 1.4 G/s against 5.4 G/s a core) its "twice the FMA rate" is half of it; widening keeps
// the half-size weight bytes and the FMA rate (two integer ops per 16 columns and k pair, against
// 16 FMAs for 8 rows). Results: the fp32 products of x and the bf16 weights, summed in fp32.
template <int ROWS>
__attribute__((always_inline)) inline void micro_widen(const float* a, int64_t lda, const uint16_t* panel, int64_t K,
                                                       float* c, int64_t ldc, int64_t cols, const uint16_t* next,
                                                       bool accumulate, int64_t pf_first = 0, int64_t pf_step = 1) {
  const int64_t K2 = (K + 1) / 2;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 acc[ROWS][3];
  tile_start<ROWS>(acc, c, ldc, accumulate && cols == NR);
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const uint16_t* p = panel + k2 * NR * 2;
    if (next != nullptr && k2 % pf_step == pf_first) prefetch_pair_row(next + k2 * NR * 2);
    const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 32), v2 = _mm512_loadu_si512(p + 64);
    const int64_t k = 2 * k2;
    {  // even k: the low halves, shifted up
      const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)),
                   w1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)),
                   w2 = _mm512_castsi512_ps(_mm512_slli_epi32(v2, 16));
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m512 av = _mm512_set1_ps(a[r * lda + k]);
        acc[r][0] = _mm512_fmadd_ps(av, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(av, w1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(av, w2, acc[r][2]);
      }
    }
    if (k + 1 < K) {  // odd k: the high halves, masked (past an odd K the panel is zero but x is not there)
      const __m512 w0 = _mm512_castsi512_ps(_mm512_and_si512(v0, high)),
                   w1 = _mm512_castsi512_ps(_mm512_and_si512(v1, high)),
                   w2 = _mm512_castsi512_ps(_mm512_and_si512(v2, high));
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m512 av = _mm512_set1_ps(a[r * lda + k + 1]);
        acc[r][0] = _mm512_fmadd_ps(av, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(av, w1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(av, w2, acc[r][2]);
      }
    }
  }
  tile_store<ROWS>(acc, c, ldc, cols, accumulate);
}

// x operands of the two products: bf16 pairs (vdpbf16ps) or fp32 rows (widened weights)
#if RS_HAVE_BF16_DOT
struct PairRows {
  const uint32_t* a;
  int64_t lda;  // in pairs
  template <int ROWS>
  void micro(int64_t m, int64_t k0, const uint16_t* slice, int64_t kc, int64_t /*K*/, float* c, int64_t ldc,
             int64_t cols, const uint16_t* next, bool acc, int64_t pf_first, int64_t pf_step) const {
    rs_bf16::micro<ROWS>(a + m * lda + k0, lda, slice, kc, c, ldc, cols, next, acc, pf_first, pf_step);
  }
};
#endif
struct FloatRows {
  const float* a;
  int64_t lda;  // in floats
  template <int ROWS>
  void micro(int64_t m, int64_t k0, const uint16_t* slice, int64_t kc, int64_t K, float* c, int64_t ldc,
             int64_t cols, const uint16_t* next, bool acc, int64_t pf_first, int64_t pf_step) const {
    rs_bf16::micro_widen<ROWS>(a + m * lda + 2 * k0, lda, slice, std::min(2 * kc, K - 2 * k0), c, ldc, cols, next, acc,
                               pf_first, pf_step);
  }
};

// c[rows x cols] = x[rows] @ one panel [K2 x 48 x 2] (x: PairRows or FloatRows; K its unpadded
// length), K block by K block (each slice stays in L2 while every row group uses it); the first
// rows' pass prefetches the slice after it, or `next_panel`.
template <class Rows>
inline void panel_product(const Rows& x, int64_t rows, const uint16_t* panel, const uint16_t* next_panel, int64_t K,
                          float* c, int64_t ldc, int64_t cols) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t k0 = 0; k0 < K2; k0 += KC2) {
    const int64_t kc = std::min(KC2, K2 - k0);
    const uint16_t* slice = panel + k0 * NR * 2;
    const uint16_t* next = k0 + KC2 < K2 ? slice + kc * NR * 2 : next_panel;
    const bool acc = k0 > 0;
    // the next slice's prefetch is spread over the first two row groups (a decode batch of 9-16 rows:
    // each asks DRAM for half, so the requests are spread over both passes)
    const int64_t pf_step = rows > MR && rows <= 2 * MR ? 2 : 1;
    int64_t m = 0;
    for (; m + MR <= rows; m += MR)
      x.template micro<MR>(m, k0, slice, kc, K, c + m * ldc, ldc, cols, m < pf_step * MR ? next : nullptr, acc, m / MR,
                           pf_step);
    const uint16_t* nx = m < pf_step * MR ? next : nullptr;
    const int64_t pf_first = m / MR;
    float* cm = c + m * ldc;
    switch (rows - m) {  // the remainder rows, fewer than MR
      case 7: x.template micro<7>(m, k0, slice, kc, K, cm, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 6: x.template micro<6>(m, k0, slice, kc, K, cm, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 5: x.template micro<5>(m, k0, slice, kc, K, cm, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 4: x.template micro<4>(m, k0, slice, kc, K, cm, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 3: x.template micro<3>(m, k0, slice, kc, K, cm, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 2: x.template micro<2>(m, k0, slice, kc, K, cm, ldc, cols, nx, acc, pf_first, pf_step); break;
      case 1: x.template micro<1>(m, k0, slice, kc, K, cm, ldc, cols, nx, acc, pf_first, pf_step); break;
      default: break;
    }
  }
}
#endif

}  // namespace rs_bf16
