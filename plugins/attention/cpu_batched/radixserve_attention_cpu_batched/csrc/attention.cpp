// Decode and extend attention straight from the token-slot KV pool (CPU; fp32 queries, an fp32 or
// bf16 pool: runtime.kv_cache_dtype=bfloat16 halves the bytes each step reads).
//
// Why: the torch path gathers every request's K and V into a padded tensor each layer and then runs
// SDPA over it; at batch 64 that copy and SDPA's per-(request, head) set-up cost more than the math.
// Here each (request, KV head) task reads its keys and values in place through the request's slot
// row and serves all query heads of its GQA group with one pass over them.
// Only the headers this kernel uses: torch/extension.h (the whole C++ frontend) takes ~4x the CPU
// time to parse, and a first start compiles every kernel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RS_ATTN_AVX2 1
#else
#define RS_ATTN_AVX2 0
#endif
// AVX-512: scores 16 keys at a time and value sums in registers (RS_NO_AVX512: the AVX2 loops, tests)
#if RS_ATTN_AVX2 && defined(__AVX512F__) && !defined(RS_NO_AVX512)
#define RS_ATTN_AVX512 1
#else
#define RS_ATTN_AVX512 0
#endif
// AVX-512 BF16: products of bf16-rounded inputs summed in fp32 (vdpbf16ps) for a bf16 pool when the
// runner allows it (runtime.cpu_matmul_precision=medium)
#if RS_ATTN_AVX512 && defined(__AVX512BF16__)
#define RS_ATTN_BF16_PRODUCTS 1
#else
#define RS_ATTN_BF16_PRODUCTS 0
#endif

namespace {

// A bf16 pool element: its bits. Stored rounded to nearest even; read exactly (widened to fp32).
using bf16_bits = uint16_t;
inline float widen(float x) { return x; }
inline float widen(bf16_bits x) { return c10::detail::f32_from_bits(x); }
inline void store_row(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
inline void store_row(const float* src, int64_t n, bf16_bits* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::detail::round_to_nearest_even(src[i]);
}

constexpr int64_t kPrefetchAhead = 8;  // slots: far enough to hide a DRAM miss, near enough to stay cached

// body(order[j], next, scratch) for j = 0..n-1, the threads taking the next index as they finish one;
// a thread claims its next task before running the current one and hands it over as `next` (-1:
// none), so the current task can start bringing the next one's rows in. Why: tasks
// differ in cost (rows of different lengths, causal query blocks), and a static split waits at the
// region's end for the thread with the costlier half, or for one the OS gave to another process
// (a served step shares two cores with the HTTP front end and the clients). `order` lists the
// costliest first so the last tasks taken are short. Each thread owns one default-made Scratch.
template <class Scratch, class Body>
void for_each_dynamic(const std::vector<int64_t>& order, const Body& body) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t j = next.fetch_add(1, std::memory_order_relaxed); j < n;) {
      const int64_t after = next.fetch_add(1, std::memory_order_relaxed);
      body(order[j], after < n ? order[after] : -1, scratch);
      j = after;
    }
  });
}

// 0..n-1 ordered by cost(i), largest first.
template <class Cost>
std::vector<int64_t> costliest_first(int64_t n, const Cost& cost) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  return order;
}

template <class KV>
inline void prefetch_row(const KV* row, int64_t elems) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < elems * static_cast<int64_t>(sizeof(KV)); i += 64) __builtin_prefetch(bytes + i, 0, 1);
}

// The key rows of the task a thread runs next, brought in one cache line per `step`. Why: a task's
// score pass streams its keys (and values) from DRAM while its softmax and value pass read only
// cached data; fetching the next task's first keys then keeps the memory busy through both.
struct LookAhead {
  const char* buf = nullptr;       // the K pool
  const int64_t* slots = nullptr;  // the next task's slots, in key order
  int64_t rows = 0, row_bytes = 0, row = 0, offset = 0;
  inline void step() {
    if (row >= rows) return;
    __builtin_prefetch(buf + slots[row] * row_bytes + offset, 0, 1);
    if ((offset += 64) >= row_bytes) offset = 0, ++row;
  }
};

// The reductions of a query row (its score dot products, the softmax sum and the exponentials)
// run in a fixed lane order: partial sum l holds the elements at offsets = l (mod 8) from the
// start, and the exponentials are taken 8 at a time from an aligned buffer. Why: with `omp simd`
// the compiler may peel iterations at run time to align a row's address, which moves elements
// between its scalar and vector code (another exp, another sum order); a query's scores sit at a
// different offset of the buffer in a decode (one query) than in an extend (several queries), so
// the same row gave different bits, and a speculative verify then did not reproduce plain decoding
// (visible after int8 activation rounding: GGUF blocks kept quantized).
constexpr int kLanes = 8;
constexpr float kExpUnderflow = -200.f;  // exp() of it is exactly 0 (finite: -ffast-math assumes no inf)

inline float lane_sum(const float* part) {
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

template <int D, class KV>
inline float dot_fixed(const float* a, const KV* b) {
  static_assert(D % kLanes == 0, "head_dim is a multiple of 8");
  float part[kLanes] = {};
  for (int j = 0; j < D; j += kLanes)
#pragma GCC unroll 8
    for (int l = 0; l < kLanes; ++l) part[l] += a[j + l] * widen(b[j + l]);
  return lane_sum(part);
}

#if RS_ATTN_AVX2
// exp(x) for x <= 0 in 8 lanes: exactly 0 below -87 (a hidden key must weigh exactly 0), else
// 2^n * p(r) with x = n ln2 + r (Cody-Waite split of ln2) and a degree-6 polynomial for e^r on
// |r| <= ln2 / 2 (relative error about 2 ulp). Why: the library's exp runs 4 lanes per call and was
// about a fifth of the decode attention's time (softmax of every score).
// The split and polynomial of exp_nonpositive (and flash_bf16.h's 16-lane exp16_nonpositive).
struct ExpConstants {
  static constexpr float lowest = -87.f, log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
  static constexpr float poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                    1.6666665459e-1f, 5.0000001201e-1f};  // highest degree first
};

inline __m256 exp_nonpositive(__m256 x) {
  using E = ExpConstants;
  const __m256 lowest = _mm256_set1_ps(E::lowest);
  const __m256 keep = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(E::log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(E::ln2_hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(E::ln2_lo), r);
  __m256 p = _mm256_set1_ps(E::poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(E::poly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), keep);
}
#endif

// sh[t] = exp(sh[t] - m) for t in [lo, n); returns their sum.
inline float exp_and_sum(float* sh, int64_t lo, int64_t n, float m) {
  alignas(32) float part[kLanes] = {};
  alignas(32) float buf[kLanes];
#if RS_ATTN_AVX2
  __m256 sum = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  int64_t t = lo;
  for (; t + kLanes <= n; t += kLanes) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sh + t), mv));
    _mm256_storeu_ps(sh + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (t < n) {  // the tail: missing lanes weigh exp(kExpUnderflow) = 0
    const int64_t c = n - t;
    for (int l = 0; l < kLanes; ++l) buf[l] = l < c ? sh[t + l] - m : kExpUnderflow;
    const __m256 e = exp_nonpositive(_mm256_load_ps(buf));
    _mm256_store_ps(buf, e);
    for (int l = 0; l < c; ++l) sh[t + l] = buf[l];
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_store_ps(part, sum);
#else
  for (int64_t t = lo; t < n; t += kLanes) {
    const int64_t c = std::min<int64_t>(kLanes, n - t);
    for (int l = 0; l < kLanes; ++l) buf[l] = l < c ? sh[t + l] - m : kExpUnderflow;
#pragma omp simd aligned(buf : 32)
    for (int l = 0; l < kLanes; ++l) buf[l] = std::exp(std::max(buf[l], kExpUnderflow));
    for (int l = 0; l < c; ++l) sh[t + l] = buf[l];
    for (int l = 0; l < kLanes; ++l) part[l] += buf[l];
  }
#endif
  return lane_sum(part);
}

#if RS_ATTN_AVX512
// 16 pool elements widened to fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_bits* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// out[t] = sum of the 16 lanes of acc[t], t = 0..15. Every add combines partials of one key, in
// the same tree for every t (so a key's score does not depend on its place in a block).
inline __m512 reduce16(const __m512 (&acc)[16]) {
  __m512 r[8], q[4];
  for (int p = 0; p < 8; ++p)  // per 128-bit block: (a0+a2, b0+b2, a1+a3, b1+b3)
    r[p] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * p], acc[2 * p + 1]), _mm512_unpackhi_ps(acc[2 * p], acc[2 * p + 1]));
  for (int p = 0; p < 4; ++p)  // per 128-bit block: keys 4p..4p+3, one partial each
    q[p] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * p], r[2 * p + 1], 0x44), _mm512_shuffle_ps(r[2 * p], r[2 * p + 1], 0xee));
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], 0x44), _mm512_shuffle_f32x4(q[0], q[1], 0xee));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], 0x44), _mm512_shuffle_f32x4(q[2], q[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xdd));
}

// s[t] = scale * (qh . key t) for t in [t0, t1), t1 - t0 <= 16, key t's head-g row at
// k_buf + slots[t] * row + g * D. Missing keys of a short block read a zero row.
template <int D, class KV>
inline void scores16(const float* qh, const KV* k_buf, const int64_t* slots, int64_t row, int64_t g, int64_t t0,
                     int64_t t1, float scale, float* s) {
  alignas(64) static const KV zeros[D] = {};
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const KV* k = t0 + j < t1 ? k_buf + slots[t0 + j] * row + g * D : zeros;
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), load16(k));
#pragma GCC unroll 16
    for (int c = 16; c < D; c += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c), load16(k + c), a);
    acc[j] = a;
  }
  const __m512 out = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(s + t0, static_cast<__mmask16>((1u << (t1 - t0)) - 1), out);
}

// out[h] (+)= sum over t in [lo, n) of p[h][t] * value t's head-g row, for NH heads h0.. of group g
// (p[h] = s + h * p_stride), then out[h] *= inv_sum[h]; accumulators stay in registers.
template <int D, int NH, class KV>
inline void values_nh(const float* s, int64_t p_stride, const KV* v_buf, const int64_t* slots, int64_t row, int64_t g,
                      int64_t lo, int64_t n, const float* inv_sum, float* out, int64_t out_head_stride, bool prefetch,
                      LookAhead* ahead) {
  constexpr int C = D / 16;
  __m512 acc[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t t = lo; t < n; ++t) {
    if (prefetch && t + kPrefetchAhead < n) prefetch_row(v_buf + slots[t + kPrefetchAhead] * row, row);
    if (ahead != nullptr) ahead->step();
    const KV* v = v_buf + slots[t] * row + g * D;
    __m512 vc[C];
    for (int c = 0; c < C; ++c) vc[c] = load16(v + 16 * c);
    for (int h = 0; h < NH; ++h) {
      const __m512 p = _mm512_set1_ps(s[h * p_stride + t]);
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(p, vc[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m512 inv = _mm512_set1_ps(inv_sum[h]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + h * out_head_stride + 16 * c, _mm512_mul_ps(acc[h][c], inv));
  }
}

// Heads per values_nh call: their accumulators (D / 16 vectors each) fill at most 16 registers.
template <int D>
constexpr int64_t kValueHeads = 256 / D;

// values_nh for a head count nh <= kValueHeads<D>.
template <int D, class KV>
inline void values_heads(int64_t nh, const float* s, int64_t p_stride, const KV* v_buf, const int64_t* slots,
                         int64_t row, int64_t g, int64_t lo, int64_t n, const float* inv_sum, float* out,
                         int64_t out_head_stride, bool prefetch, LookAhead* ahead) {
  auto run = [&](auto heads) {
    values_nh<D, decltype(heads)::value>(s, p_stride, v_buf, slots, row, g, lo, n, inv_sum, out, out_head_stride,
                                         prefetch, ahead);
  };
  if constexpr (D == 64) {
    switch (nh) {
      case 4: run(std::integral_constant<int, 4>()); break;
      case 3: run(std::integral_constant<int, 3>()); break;
      case 2: run(std::integral_constant<int, 2>()); break;
      default: run(std::integral_constant<int, 1>()); break;
    }
  } else if constexpr (D == 128) {
    if (nh == 2) run(std::integral_constant<int, 2>());
    else run(std::integral_constant<int, 1>());
  } else {
    run(std::integral_constant<int, 1>());
  }
}
#endif

#if RS_ATTN_BF16_PRODUCTS
// Attention's two products with bf16 inputs and fp32 sums (runtime.cpu_matmul_precision=medium over
// a bf16 pool): a query is rounded to bf16 once, the keys are used as stored, the softmax weights
// are rounded to bf16 for the value sum (its 1 / sum stays the fp32 sum's). vdpbf16ps adds two
// products a lane, so the dot products take half the instructions and no widening of the pool.

// qw = the D values at q rounded to nearest even bf16, two a word, in the pool's element order.
template <int D>
inline void round_query(const float* q, uint32_t* qw) {
  for (int c = 0; c < D / 32; ++c)
    _mm512_storeu_si512(reinterpret_cast<void*>(qw + 16 * c),
                        reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * c + 16), _mm512_loadu_ps(q + 32 * c))));
}

inline __m512bh load32(const bf16_bits* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(p)));
}

// scores16 with bf16 products: s[t] = scale * (qb . key t), the same reduction tree across keys.
template <int D>
inline void scores16_bf16(const uint32_t* qw, const bf16_bits* k_buf, const int64_t* slots, int64_t row, int64_t g,
                          int64_t t0, int64_t t1, float scale, float* s) {
  alignas(64) static const bf16_bits zeros[D] = {};
  __m512bh qb[D / 32];
  for (int c = 0; c < D / 32; ++c) qb[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(qw + 16 * c)));
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const bf16_bits* k = t0 + j < t1 ? k_buf + slots[t0 + j] * row + g * D : zeros;
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[0], load32(k));
#pragma GCC unroll 8
    for (int c = 1; c < D / 32; ++c) a = _mm512_dpbf16_ps(a, qb[c], load32(k + 32 * c));
    acc[j] = a;
  }
  const __m512 out = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(s + t0, static_cast<__mmask16>((1u << (t1 - t0)) - 1), out);
}

// pairs[r] = (p[lo + 2r], p[lo + 2r + 1]) rounded to bf16, one 32-bit word each, r < ceil((n - lo) / 2);
// a missing last weight is 0.
inline void weight_pairs(const float* p, int64_t lo, int64_t n, uint32_t* pairs) {
  int64_t t = lo;
  for (; t + 32 <= n; t += 32)
    _mm512_storeu_si512(reinterpret_cast<void*>(pairs + (t - lo) / 2),
                        reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + t + 16), _mm512_loadu_ps(p + t))));
  if (t < n) {
    const __mmask16 m0 = static_cast<__mmask16>(n - t >= 16 ? 0xffff : (1u << (n - t)) - 1);
    const __mmask16 m1 = static_cast<__mmask16>(n - t >= 32 ? 0xffff : n - t > 16 ? (1u << (n - t - 16)) - 1 : 0);
    const __m512i w = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, p + t + 16), _mm512_maskz_loadu_ps(m0, p + t)));
    alignas(64) uint32_t tail[16];
    _mm512_store_si512(reinterpret_cast<void*>(tail), w);
    std::copy(tail, tail + (n - t + 1) / 2, pairs + (t - lo) / 2);
  }
}

// values_nh with bf16 products: keys taken two at a time, their rows interleaved element by element
// so each lane holds (value t, value t + 1) of one element; the NH heads' weight pairs at
// pairs + h * pair_stride. Accumulator lane 4L + j of the low / high half of 32-element chunk c
// holds element 32c + 8L + j / 32c + 8L + 4 + j (the 128-bit lanes of the unpacks).
template <int D, int NH>
inline void values_nh_bf16(const uint32_t* pairs, int64_t pair_stride, const bf16_bits* v_buf, const int64_t* slots,
                           int64_t row, int64_t g, int64_t lo, int64_t n, const float* inv_sum, float* out,
                           int64_t out_head_stride, bool prefetch, LookAhead* ahead) {
  constexpr int C = D / 32;
  alignas(64) static const bf16_bits zeros[D] = {};
  __m512 acc[NH][C][2];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) acc[h][c][0] = acc[h][c][1] = _mm512_setzero_ps();
  for (int64_t t = lo; t < n; t += 2) {
    if (prefetch && t + kPrefetchAhead + 1 < n) {
      prefetch_row(v_buf + slots[t + kPrefetchAhead] * row, row);
      prefetch_row(v_buf + slots[t + kPrefetchAhead + 1] * row, row);
    }
    if (ahead != nullptr) ahead->step(), ahead->step();
    const bf16_bits* a = v_buf + slots[t] * row + g * D;
    const bf16_bits* b = t + 1 < n ? v_buf + slots[t + 1] * row + g * D : zeros;
    __m512bh lo_pairs[C], hi_pairs[C];
    for (int c = 0; c < C; ++c) {
      const __m512i va = _mm512_loadu_si512(reinterpret_cast<const void*>(a + 32 * c));
      const __m512i vb = _mm512_loadu_si512(reinterpret_cast<const void*>(b + 32 * c));
      lo_pairs[c] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(va, vb));
      hi_pairs[c] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(va, vb));
    }
    for (int h = 0; h < NH; ++h) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pairs[h * pair_stride + (t - lo) / 2])));
      for (int c = 0; c < C; ++c) {
        acc[h][c][0] = _mm512_dpbf16_ps(acc[h][c][0], lo_pairs[c], w);
        acc[h][c][1] = _mm512_dpbf16_ps(acc[h][c][1], hi_pairs[c], w);
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m512 inv = _mm512_set1_ps(inv_sum[h]);
    for (int c = 0; c < C; ++c) {
      // 128-bit lanes [lo0 lo1 lo2 lo3], [hi0 ...] -> elements [lo0 hi0 lo1 hi1], [lo2 hi2 lo3 hi3]
      const __m512 first = _mm512_shuffle_f32x4(acc[h][c][0], acc[h][c][1], 0x44);
      const __m512 second = _mm512_shuffle_f32x4(acc[h][c][0], acc[h][c][1], 0xee);
      float* o = out + h * out_head_stride + 32 * c;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_shuffle_f32x4(first, first, 0xd8), inv));
      _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_shuffle_f32x4(second, second, 0xd8), inv));
    }
  }
}

// values_nh_bf16 for a head count nh <= kValueHeadsBf16<D>.
template <int D>
inline void values_heads_bf16(int64_t nh, const uint32_t* pairs, int64_t pair_stride, const bf16_bits* v_buf,
                              const int64_t* slots, int64_t row, int64_t g, int64_t lo, int64_t n,
                              const float* inv_sum, float* out, int64_t out_head_stride, bool prefetch,
                              LookAhead* ahead) {
  auto run = [&](auto heads) {
    values_nh_bf16<D, decltype(heads)::value>(pairs, pair_stride, v_buf, slots, row, g, lo, n, inv_sum, out,
                                              out_head_stride, prefetch, ahead);
  };
  if constexpr (D == 64) {
    if (nh == 3) return run(std::integral_constant<int, 3>());
  }
  if constexpr (D <= 128) {
    if (nh == 2) return run(std::integral_constant<int, 2>());
  }
  run(std::integral_constant<int, 1>());
}
#endif

// A speculative verify's tree mask for one block of queries: query i may attend the new key
// t >= new_start iff rows[i * stride + t - new_start] (keys before new_start, the prefix, always).
struct TreeMask {
  const bool* rows = nullptr;  // nullptr: plain causal attention
  int64_t stride = 0;
  int64_t new_start = 0;
  const int64_t* depth = nullptr;  // depth of each of the request's new tokens (a draft sits at new_start + depth)
  int64_t first_query = 0;         // the request's new-token index of query 0
};

// Per-layer options: a sliding window (0: none; else a query at position p sees keys at positions
// > p - window) and soft-capping of the scores (0: none; else cap * tanh(score / cap)).
struct LayerOptions {
  int64_t window = 0;
  float cap = 0.f;
};

#include "flash_bf16.h"

// One request's queries i = 0..nq-1 (rows q + i * q_stride), every query head of each: query i
// attends causally over the first first_len + i keys at `slots` (decode: nq = 1, first_len = the
// sequence length), and among those only the ones `tree` allows when it has rows. The query heads
// of a KV head's group share its keys; each key and value row is read once for all queries and
// heads (whole rows, in slot order, prefetched ahead). Not inlined: decode and extend then run the
// same machine code (-ffast-math lets each inlined copy be reassociated differently).
// Heads per values_nh_bf16 call (twice the accumulators of values_nh a head); also sizes the weight
// pairs in AttendScratch::words.
template <int D>
constexpr int64_t kValueHeadsBf16 = D == 64 ? 3 : D == 128 ? 2 : 1;

// A thread's buffers for attend_queries, reused across its tasks.
struct AttendScratch {
  std::vector<float> scores;   // [nq * hq * len] scores, then weights; then [nq * hq] 1 / sums
  std::vector<uint32_t> words;  // bf16 products: the bf16 queries, then a value pass's weight pairs
  std::vector<int64_t> seen;    // a query's visible keys when some in [lo, n) are hidden
  std::vector<float> packed;    // their exponentials
  std::vector<int64_t> visible_slots;  // their slots, from index lo (AVX-512 value pass)
};

// Bf16: products of bf16-rounded inputs summed in fp32 (a bf16 pool, RS_ATTN_BF16_PRODUCTS builds).
template <int D, class KV, bool Bf16 = false>
__attribute__((noinline)) void attend_queries(const float* q, int64_t q_stride, int64_t nq, int64_t hq, int64_t hkv, const KV* k_buf,
                    const KV* v_buf, const int64_t* slots, int64_t first_len, float scale, float* out,
                    int64_t out_stride, AttendScratch& scratch, const TreeMask& tree = TreeMask(),
                    const LayerOptions& opt = LayerOptions(), LookAhead* ahead = nullptr) {
  static_assert(!Bf16 || (RS_ATTN_BF16_PRODUCTS && std::is_same_v<KV, bf16_bits>), "bf16 products: a bf16 pool");
  const int64_t group = hq / hkv, row = hkv * D, len = first_len + nq - 1;
  scratch.scores.resize(static_cast<size_t>(nq * hq * (len + 1)));
  float* s = scratch.scores.data();  // s[(i * hq + h) * len + t]
  uint32_t* qw = nullptr;  // bf16 products: query i's heads, D / 2 words each
  uint32_t* pairs = nullptr;  // bf16 products: a value pass's weight pairs, (len + 1) / 2 words a head
  const int64_t pair_stride = (len + 1) / 2;
  if constexpr (Bf16) {
    scratch.words.resize(static_cast<size_t>(hq * D / 2 + kValueHeadsBf16<D> * pair_stride));
    qw = scratch.words.data();
    pairs = qw + hq * D / 2;
  }
  // key t is seen by queries i >= t - first_len + 1
  auto first_query = [&](int64_t t) { return std::max<int64_t>(0, t - first_len + 1); };
  // absolute positions: a key's is its index, a draft token's is new_start + its depth
  auto key_pos = [&](int64_t t) { return tree.depth != nullptr && t >= tree.new_start ? tree.new_start + tree.depth[t - tree.new_start] : t; };
  auto query_pos = [&](int64_t i) { return tree.depth != nullptr ? tree.new_start + tree.depth[tree.first_query + i] : first_len - 1 + i; };
  // with a window, keys before the earliest query's window are never seen (queries sit at or after
  // new_start in a tree, at first_len - 1 onward otherwise)
  const int64_t lo = opt.window > 0 ? std::max<int64_t>(0, (tree.depth != nullptr ? tree.new_start : first_len - 1) - opt.window + 1) : 0;
#if RS_ATTN_AVX512
  // query i's scores, 16 keys at a time for every head (the block's rows stay in L1 meanwhile)
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t n = first_len + i;
#if RS_ATTN_BF16_PRODUCTS
    if constexpr (Bf16)
      for (int64_t h = 0; h < hq; ++h) round_query<D>(q + i * q_stride + h * D, qw + h * D / 2);
#endif
    for (int64_t t0 = lo; t0 < n; t0 += 16) {
      // the first query brings each key row in: fetch the next block's keys and this block's values (the
      // value pass follows), a few rows before each head's scores. Why not all 32 rows (192 cache lines in a bf16
      // pool) at the block's start: likely more misses than the core tracks at once, and the block then waited
      // on memory (session 16, cpu_decode_attention.py: 4-15% faster a layer spread; prefetches change no bits).
      const KV* ahead_rows[32];
      int64_t n_ahead = 0;
      if (i == 0)
        for (int64_t t = t0 + 16; t < std::min(n, t0 + 32); ++t) {
          ahead_rows[n_ahead++] = k_buf + slots[t] * row;
          ahead_rows[n_ahead++] = v_buf + slots[t - 16] * row;
        }
      const int64_t per_head = (n_ahead + hq - 1) / hq;
      for (int64_t h = 0; h < hq; ++h) {
        for (int64_t r = h * per_head; r < std::min(n_ahead, (h + 1) * per_head); ++r) prefetch_row(ahead_rows[r], row);
#if RS_ATTN_BF16_PRODUCTS
        if constexpr (Bf16) {
          scores16_bf16<D>(qw + h * D / 2, k_buf, slots, row, h / group, t0, std::min(n, t0 + 16), scale,
                           s + (i * hq + h) * len);
          continue;
        }
#endif
        scores16<D>(q + i * q_stride + h * D, k_buf, slots, row, h / group, t0, std::min(n, t0 + 16), scale,
                    s + (i * hq + h) * len);
      }
    }
    if (opt.cap > 0.f)
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t t = lo; t < n; ++t) s[(i * hq + h) * len + t] = opt.cap * std::tanh(s[(i * hq + h) * len + t] / opt.cap);
  }
#else
  for (int64_t t = lo; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_row(k_buf + slots[t + kPrefetchAhead] * row, row);
    const KV* k_row = k_buf + slots[t] * row;
    for (int64_t i = first_query(t); i < nq; ++i) {
      const float* qi = q + i * q_stride;
      const KV* k = k_row;
      for (int64_t g = 0; g < hkv; ++g, k += D) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qh = qi + h * D;
          float acc = dot_fixed<D>(qh, k) * scale;
          if (opt.cap > 0.f) acc = opt.cap * std::tanh(acc / opt.cap);
          s[(i * hq + h) * len + t] = acc;
        }
      }
    }
  }
#endif
  float* inv_sum = s + nq * hq * len;  // [nq * hq], in the caller's buffer: no allocation per call
  std::vector<int64_t>& seen = scratch.seen;
  std::vector<float>& packed = scratch.packed;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t n = first_len + i;
    const int64_t oldest = opt.window > 0 ? query_pos(i) - opt.window : -1;  // keys at or before it are hidden
    // Hidden keys (not ancestors in a draft tree, or out of a window) weigh 0. The exponentials are
    // then summed over the visible keys packed in order: the lanes of the sum (and so its bits) are
    // those of the same token's decode step, whose visible keys are contiguous from lo. Summed in
    // place, a hidden key would shift the later ones to other lanes, and rounding after attention
    // (bf16 matmul inputs or KV, int8 GGUF activations) amplifies that last bit.
    seen.clear();
    bool hides = false;
    // only trees and windows hide keys: a plain causal row (every decode and prefill) skips the scan
    for (int64_t t = lo; (tree.rows != nullptr || opt.window > 0) && t < n; ++t) {
      const bool hidden = (tree.rows != nullptr && t >= tree.new_start && !tree.rows[i * tree.stride + t - tree.new_start]) ||
                          (opt.window > 0 && key_pos(t) <= oldest);
      if (hidden) hides = true;
      else seen.push_back(t);
    }
    for (int64_t h = 0; h < hq; ++h) {
      float* sh = s + (i * hq + h) * len;
      if (!hides) {
        float m = -INFINITY;
        for (int64_t t = lo; t < n; ++t) m = std::max(m, sh[t]);
        inv_sum[i * hq + h] = 1.f / exp_and_sum(sh, lo, n, m);
        continue;
      }
      const int64_t nv = static_cast<int64_t>(seen.size());
      packed.resize(static_cast<size_t>(nv));
      float m = -INFINITY;
      for (int64_t r = 0; r < nv; ++r) m = std::max(m, packed[r] = sh[seen[r]]);
      inv_sum[i * hq + h] = 1.f / exp_and_sum(packed.data(), 0, nv, m);
#if RS_ATTN_AVX512
      std::copy(packed.begin(), packed.end(), sh + lo);  // the value pass takes the visible keys packed from lo
#else
      for (int64_t t = lo; t < n; ++t) sh[t] = 0.f;  // the value pass weighs every key in [lo, n)
      for (int64_t r = 0; r < nv; ++r) sh[seen[r]] = packed[r];
#endif
    }
#if RS_ATTN_AVX512
    // the query's weighted value sums over its visible keys (all of [lo, n), or those packed above:
    // pairs of keys in a bf16 product are then the same as in the same token's decode step),
    // kValueHeads<D> heads of a KV group at a time
    const int64_t* vslots = slots;
    int64_t vn = n;
    if (hides) {
      scratch.visible_slots.resize(static_cast<size_t>(lo + seen.size()));
      for (size_t r = 0; r < seen.size(); ++r) scratch.visible_slots[lo + r] = slots[seen[r]];
      vslots = scratch.visible_slots.data();
      vn = lo + static_cast<int64_t>(seen.size());
    }
    for (int64_t g = 0; g < hkv; ++g) {
#if RS_ATTN_BF16_PRODUCTS
      if constexpr (Bf16) {
        for (int64_t h = g * group; h < (g + 1) * group; h += kValueHeadsBf16<D>) {
          const int64_t nh = std::min<int64_t>(kValueHeadsBf16<D>, (g + 1) * group - h);
          for (int64_t k = 0; k < nh; ++k) weight_pairs(s + (i * hq + h + k) * len, lo, vn, pairs + k * pair_stride);
          values_heads_bf16<D>(nh, pairs, pair_stride, v_buf, vslots, row, g, lo, vn, inv_sum + i * hq + h,
                               out + i * out_stride + h * D, D, i == 0 && h == 0, ahead);
        }
        continue;
      }
#endif
      for (int64_t h = g * group; h < (g + 1) * group; h += kValueHeads<D>) {
        const int64_t nh = std::min<int64_t>(kValueHeads<D>, (g + 1) * group - h);
        values_heads<D>(nh, s + (i * hq + h) * len, len, v_buf, vslots, row, g, lo, vn, inv_sum + i * hq + h,
                        out + i * out_stride + h * D, D, i == 0 && h == 0, ahead);
      }
    }
#endif
  }
#if !RS_ATTN_AVX512
  for (int64_t i = 0; i < nq; ++i) std::fill(out + i * out_stride, out + i * out_stride + hq * D, 0.f);
  for (int64_t t = lo; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_row(v_buf + slots[t + kPrefetchAhead] * row, row);
    const KV* v_row = v_buf + slots[t] * row;
    for (int64_t i = first_query(t); i < nq; ++i) {
      const KV* v = v_row;
      for (int64_t g = 0; g < hkv; ++g, v += D) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const float p = s[(i * hq + h) * len + t];
          float* oh = out + i * out_stride + h * D;
#pragma omp simd
          for (int j = 0; j < D; ++j) oh[j] += p * widen(v[j]);
        }
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t h = 0; h < hq; ++h) {
      float* oh = out + i * out_stride + h * D;
      const float inv = inv_sum[i * hq + h];
      for (int j = 0; j < D; ++j) oh[j] *= inv;
    }
#endif
}

template <int D, class KV, bool Bf16>
void run(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& out_loc,
         at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& table, const at::Tensor& rows,
         const at::Tensor& seq_lens, double scale, const LayerOptions& opt, at::Tensor& out) {
  const int64_t bs = q.size(0), hkv = k_buf.size(1), hq = q.size(1) / D, row = hkv * D;
  const float* qp = q.data_ptr<float>();
  KV* kp = static_cast<KV*>(k_buf.data_ptr());
  KV* vp = static_cast<KV*>(v_buf.data_ptr());
  const float* knp = k_new.data_ptr<float>();
  const float* vnp = v_new.data_ptr<float>();
  const int64_t* locp = out_loc.data_ptr<int64_t>();
  const int64_t skn = k_new.stride(0), svn = v_new.stride(0);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t table_stride = table.stride(0);
  const auto order = costliest_first(bs, [&](int64_t b) { return lp[b]; });
  for_each_dynamic<AttendScratch>(order, [&](int64_t b, int64_t next, AttendScratch& scratch) {
    LookAhead ahead;
    if (next >= 0) {  // its cached keys the decode will read: all, or the window's
      const int64_t first = opt.window > 0 ? std::max<int64_t>(0, lp[next] - opt.window) : 0;
      ahead = {reinterpret_cast<const char*>(kp), tp + rp[next] * table_stride + first, lp[next] - 1 - first,
               static_cast<int64_t>(row * sizeof(KV))};
    }
    // the new token's K/V first: its slot is this request's own (never a shared prefix slot)
    store_row(knp + b * skn, row, kp + locp[b] * row);
    store_row(vnp + b * svn, row, vp + locp[b] * row);
    attend_queries<D, KV, Bf16>(qp + b * hq * D, hq * D, 1, hq, hkv, kp, vp, tp + rp[b] * table_stride, lp[b],
                                static_cast<float>(scale), op + b * hq * D, hq * D, scratch, TreeMask(), opt, &ahead);
  });
}

// Extend: all new K/V are stored first (a request's queries read each other's), then one task per
// block of up to kQueryBlock queries of one request; with bf16 products, a plain causal request of at
// least flash_min_extend new tokens (0: none) runs as flash tasks instead (flash_bf16.h).
constexpr int64_t kQueryBlock = 16;

// A thread's buffers for either kind of extend task.
struct ExtendScratch {
  AttendScratch attend;
#if RS_ATTN_BF16_PRODUCTS
  FlashScratch flash;
#endif
};

template <int D, class KV, bool Bf16>
void run_extend(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                const at::Tensor& out_loc, at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& table,
                const at::Tensor& rows, const at::Tensor& seq_lens, const at::Tensor& extend_lens,
                const at::Tensor& tree_mask, const at::Tensor& mask_offsets, const at::Tensor& depths,
                double scale, const LayerOptions& opt, int64_t flash_min_extend, at::Tensor& out) {
  const int64_t n = q.size(0), bs = rows.size(0), hkv = k_buf.size(1), hq = q.size(1) / D, row = hkv * D;
  const float* qp = q.data_ptr<float>();
  KV* kp = static_cast<KV*>(k_buf.data_ptr());
  KV* vp = static_cast<KV*>(v_buf.data_ptr());
  const float* knp = k_new.data_ptr<float>();
  const float* vnp = v_new.data_ptr<float>();
  const int64_t* locp = out_loc.data_ptr<int64_t>();
  const int64_t skn = k_new.stride(0), svn = v_new.stride(0);
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      store_row(knp + i * skn, row, kp + locp[i] * row);
      store_row(vnp + i * svn, row, vp + locp[i] * row);
    }
  });
  struct Task { int64_t req, q_row, first_query, count; };
  std::vector<Task> tasks;
  const int64_t* ep = extend_lens.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const bool* mp = tree_mask.numel() ? tree_mask.data_ptr<bool>() : nullptr;
#if RS_ATTN_BF16_PRODUCTS
  std::vector<FlashTask> flash;  // task index tasks.size() + f
  const std::pair<int64_t, int64_t> shape = flash_shape(hq / hkv);
  const int64_t qv = shape.first, heads_per_task = shape.second, group = hq / hkv;
  TORCH_CHECK(qv >= 1 && heads_per_task >= 1 && qv * heads_per_task <= kFlashMaxVectors,
              "extend_attention: a flash task of ", qv * heads_per_task, " row vectors (1..", kFlashMaxVectors, ")");
#endif
  int64_t q_row = 0;
  for (int64_t r = 0; r < bs; ++r) {
#if RS_ATTN_BF16_PRODUCTS
    if (Bf16 && mp == nullptr && flash_min_extend > 0 && ep[r] >= flash_min_extend) {
      for (int64_t i = 0; i < ep[r]; i += 16 * qv)
        for (int64_t g = 0; g < hkv; ++g)
          for (int64_t h = g * group; h < (g + 1) * group; h += heads_per_task)
            flash.push_back({r, q_row + i, i, std::min(16 * qv, ep[r] - i), g, h,
                             std::min(heads_per_task, (g + 1) * group - h), qv});
      q_row += ep[r];
      continue;
    }
#endif
    for (int64_t i = 0; i < ep[r]; i += kQueryBlock) tasks.push_back({r, q_row + i, i, std::min(kQueryBlock, ep[r] - i)});
    q_row += ep[r];
  }
  TORCH_CHECK(q_row == n, "extend_attention: extend_lens do not sum to the query rows");
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t table_stride = table.stride(0), width = hq * D;
  const int64_t* mop = mask_offsets.numel() ? mask_offsets.data_ptr<int64_t>() : nullptr;
  const int64_t* dp = depths.numel() ? depths.data_ptr<int64_t>() : nullptr;  // packed like the queries
  std::vector<int64_t> req_start(static_cast<size_t>(bs), 0);  // first packed row of each request
  for (int64_t r = 1; r < bs; ++r) req_start[r] = req_start[r - 1] + ep[r - 1];
  const int64_t n_rows = static_cast<int64_t>(tasks.size());
  int64_t n_tasks = n_rows;
#if RS_ATTN_BF16_PRODUCTS
  n_tasks += static_cast<int64_t>(flash.size());
#endif
  // a task's cost: its query heads times the keys they see
  const auto order = costliest_first(n_tasks, [&](int64_t j) {
#if RS_ATTN_BF16_PRODUCTS
    if (j >= n_rows) {
      const FlashTask& f = flash[j - n_rows];
      return f.q_count * f.heads * (lp[f.req] - ep[f.req] + f.q_first + f.q_count);
    }
#endif
    const Task& t = tasks[j];
    return t.count * hq * (lp[t.req] - ep[t.req] + t.first_query + t.count);
  });
  for_each_dynamic<ExtendScratch>(order, [&](int64_t j, int64_t, ExtendScratch& both) {
#if RS_ATTN_BF16_PRODUCTS
    if constexpr (Bf16) {
      if (j >= n_rows) {
        const FlashTask& f = flash[j - n_rows];
        flash_task_any<D>(f, qp, width, kp, vp, row, tp + rp[f.req] * table_stride, lp[f.req] - ep[f.req],
                          static_cast<float>(scale), opt, op, both.flash);
        return;
      }
    }
#endif
    AttendScratch& scratch = both.attend;
    const Task& task = tasks[j];
    const int64_t prefix = lp[task.req] - ep[task.req];
    TreeMask tree;
    if (mp != nullptr) {  // request task.req's [ext, ext] block, from this block's first query row
      tree.stride = ep[task.req];
      tree.rows = mp + mop[task.req] + task.first_query * tree.stride;
      tree.new_start = prefix;
      if (dp != nullptr) {
        tree.depth = dp + req_start[task.req];
        tree.first_query = task.first_query;
      }
    }
    attend_queries<D, KV, Bf16>(qp + task.q_row * width, width, task.count, hq, hkv, kp, vp,
                                tp + rp[task.req] * table_stride, prefix + task.first_query + 1,
                                static_cast<float>(scale), op + task.q_row * width, width, scratch, tree, opt);
  });
}

}  // namespace

namespace {

// Shapes and dtypes shared by both entry points; n = query rows (one per new token).
void check_inputs(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                  const at::Tensor& out_loc, const at::Tensor& k_buf, const at::Tensor& v_buf,
                  const at::Tensor& table, const at::Tensor& rows, const at::Tensor& seq_lens, int64_t bs) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_new.scalar_type() == at::kFloat && v_new.scalar_type() == at::kFloat,
              "attention: fp32 queries and new k/v only");
  TORCH_CHECK((k_buf.scalar_type() == at::kFloat || k_buf.scalar_type() == at::kBFloat16) &&
                  v_buf.scalar_type() == k_buf.scalar_type(), "attention: an fp32 or bf16 KV pool only");
  TORCH_CHECK(table.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong && out_loc.scalar_type() == at::kLong,
              "attention: int64 indices");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && table.stride(1) == 1, "attention: layout");
  const int64_t n = q.size(0), row_floats = k_buf.size(1) * k_buf.size(2);
  TORCH_CHECK(rows.numel() == bs && seq_lens.numel() == bs && out_loc.numel() == n && rows.is_contiguous() &&
                  seq_lens.is_contiguous() && out_loc.is_contiguous(), "attention: one row and length per request, one slot per token");
  TORCH_CHECK(k_new.dim() == 2 && v_new.dim() == 2 && k_new.size(0) == n && v_new.size(0) == n &&
                  k_new.size(1) == row_floats && v_new.size(1) == row_floats && k_new.stride(1) == 1 &&
                  v_new.stride(1) == 1, "attention: new k/v shape");
  const int64_t d = k_buf.size(2);
  TORCH_CHECK(q.size(1) % d == 0 && (q.size(1) / d) % k_buf.size(1) == 0 && q.size(1) / d <= 64,
              "attention: head counts");
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "attention: head_dim ", d, " not compiled (64, 128, 256)");
}

template <class T>
struct Type {
  using type = T;
};

// body(head_dim constant, Type<pool element>, bf16 products constant) for the pool's head_dim (64,
// 128, 256) and dtype; bf16 products only for a bf16 pool of a build that has them (checked).
template <class Body>
void dispatch(const at::Tensor& k_buf, bool bf16_products, const Body& body) {
  auto with_dim = [&](auto kv, auto bf16) {
    switch (k_buf.size(2)) {
      case 64: body(std::integral_constant<int, 64>(), kv, bf16); break;
      case 128: body(std::integral_constant<int, 128>(), kv, bf16); break;
      default: body(std::integral_constant<int, 256>(), kv, bf16); break;
    }
  };
  TORCH_CHECK(!bf16_products || (RS_ATTN_BF16_PRODUCTS && k_buf.scalar_type() == at::kBFloat16),
              "attention: bf16 products need a bf16 pool and a build with AVX-512 BF16 (bf16_products_available)");
  if (k_buf.scalar_type() == at::kBFloat16) {
#if RS_ATTN_BF16_PRODUCTS
    if (bf16_products) return with_dim(Type<bf16_bits>(), std::true_type());
#endif
    with_dim(Type<bf16_bits>(), std::false_type());
  } else {
    with_dim(Type<float>(), std::false_type());
  }
}

}  // namespace

// Stores each request's new k, v ([bs, num_kv_heads * head_dim], rows may be strided) at its slot
// out_loc[b] (rounded to nearest even in a bf16 pool), then attends. q: [bs, num_heads * head_dim]
// fp32; k_buf, v_buf: [slots, num_kv_heads, head_dim] fp32 or bf16, contiguous; table: [rows, max_context] int64 slot table; rows, seq_lens, out_loc: [bs]
// int64. window: sliding window (0: none); cap: score soft-cap (0: none); bf16_products (a bf16 pool,
// bf16_products_available): the score and value products take bf16-rounded queries and weights and
// sum in fp32 (runtime.cpu_matmul_precision=medium). Returns [bs, num_heads * head_dim].
at::Tensor decode_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new, at::Tensor out_loc,
                               at::Tensor k_buf, at::Tensor v_buf, at::Tensor table, at::Tensor rows,
                               at::Tensor seq_lens, double scale, int64_t window, double cap, bool bf16_products) {
  check_inputs(q, k_new, v_new, out_loc, k_buf, v_buf, table, rows, seq_lens, q.size(0));
  TORCH_CHECK(window >= 0 && cap >= 0, "decode_attention: window and cap must be >= 0");
  const LayerOptions opt{window, static_cast<float>(cap)};
  q = q.contiguous();
  auto out = at::empty_like(q);
  dispatch(k_buf, bf16_products, [&](auto d, auto kv, auto bf16) {
    run<decltype(d)::value, typename decltype(kv)::type, decltype(bf16)::value>(q, k_new, v_new, out_loc, k_buf, v_buf,
                                                                               table, rows, seq_lens, scale, opt, out);
  });
  return out;
}

// Extend (prefill chunks): request b's extend_lens[b] new tokens are rows of q, k_new, v_new (packed
// in request order) at positions seq_lens[b] - extend_lens[b] onward; stores every new k, v at its
// out_loc slot, then causal attention over the request's slot row. With a non-empty tree_mask (a
// speculative verify: flat bool, request b's row-major [e, e] block at mask_offsets[b]) new token a
// sees new token c only where the block says so; the prefix stays fully visible. depths (int64 [n],
// with a tree mask and a window only; else empty): each new token's depth in its draft tree, which
// places it at position prefix + depth for the window. window, cap, bf16_products: as decode_attention.
// flash_min_extend (bf16 products only; 0: never): a request without a tree mask adding at least this
// many tokens runs the tiled kernel of flash_bf16.h (other bits than the per-row kernel's, within the
// same bf16 rounding). Returns [n, num_heads * head_dim].
at::Tensor extend_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new, at::Tensor out_loc,
                               at::Tensor k_buf, at::Tensor v_buf, at::Tensor table, at::Tensor rows,
                               at::Tensor seq_lens, at::Tensor extend_lens, at::Tensor tree_mask,
                               at::Tensor mask_offsets, at::Tensor depths, double scale, int64_t window,
                               double cap, bool bf16_products, int64_t flash_min_extend) {
  check_inputs(q, k_new, v_new, out_loc, k_buf, v_buf, table, rows, seq_lens, rows.numel());
  TORCH_CHECK(window >= 0 && cap >= 0, "extend_attention: window and cap must be >= 0");
  TORCH_CHECK(depths.numel() == 0 || (depths.scalar_type() == at::kLong && depths.is_contiguous() &&
                                      depths.numel() == q.size(0) && tree_mask.numel()),
              "extend_attention: depths must be empty or one int64 per query row (with a tree mask)");
  const LayerOptions opt{window, static_cast<float>(cap)};
  TORCH_CHECK(extend_lens.scalar_type() == at::kLong && extend_lens.is_contiguous() &&
                  extend_lens.numel() == rows.numel(), "extend_attention: one extend length per request");
  if (tree_mask.numel()) {
    TORCH_CHECK(tree_mask.scalar_type() == at::kBool && tree_mask.is_contiguous() && !tree_mask.is_cuda(),
                "extend_attention: tree_mask must be a contiguous CPU bool tensor");
    TORCH_CHECK(mask_offsets.scalar_type() == at::kLong && mask_offsets.is_contiguous() &&
                    mask_offsets.numel() == rows.numel(), "extend_attention: one mask offset per request");
    const int64_t* ep = extend_lens.data_ptr<int64_t>();
    const int64_t* mop = mask_offsets.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows.numel(); ++b)
      TORCH_CHECK(mop[b] >= 0 && mop[b] + ep[b] * ep[b] <= tree_mask.numel(), "extend_attention: tree_mask too short");
  }
  q = q.contiguous();
  auto out = at::empty_like(q);
  dispatch(k_buf, bf16_products, [&](auto d, auto kv, auto bf16) {
    run_extend<decltype(d)::value, typename decltype(kv)::type, decltype(bf16)::value>(
        q, k_new, v_new, out_loc, k_buf, v_buf, table, rows, seq_lens, extend_lens, tree_mask, mask_offsets, depths,
        scale, opt, flash_min_extend, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // whether bf16_products=True is available (AVX-512 BF16 in this build)
  m.attr("bf16_products_available") = static_cast<bool>(RS_ATTN_BF16_PRODUCTS);
  // whether the AVX-512 score blocks and register value sums are built (the per-row extend's speed)
  m.attr("avx512") = static_cast<bool>(RS_ATTN_AVX512);
  m.def("decode_attention", &decode_attention, "store the new K/V, then decode attention over an fp32 or bf16 KV pool");
  m.def("extend_attention", &extend_attention, "store the new K/V, then causal (or tree-masked) extend attention over an fp32 or bf16 KV pool");
}
