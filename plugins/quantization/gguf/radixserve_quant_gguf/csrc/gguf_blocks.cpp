// GGUF Q4_0 / Q4_1 / Q8_0 weights kept in their file blocks: y = x @ W^T with int8 dot products.
//
// A weight is uint8 [N, K / 32 * block_bytes], each row the file's blocks of 32 inputs:
//   Q4_0: f16 d, 16 bytes of nibbles            value = d * (q - 8)
//   Q4_1: f16 d, f16 m, 16 bytes of nibbles     value = d * q + m
//   Q8_0: f16 d, 32 int8                        value = d * q
// (nibble byte j holds input j in its low half and input j + 16 in its high half).
// The activation row is quantized per 32-block to int8 with one fp32 scale dx and the block sum
// sx = dx * sum(q) (llama.cpp's q8_1), so each weight block costs one 32-wide int8 dot product:
//   Q4_0: dw * dx * dot(q, qx) - 8 * dw * sx      Q4_1: dw * dx * dot(q, qx) + m * sx
// or, with act_bits = 16, to int16 the same way (scale amax / 32767), the dots then int16 x weight
// codes widened to int16 (vpdpwssd / vpmaddwd): half the int8 rate, but the activation rounding
// (0.4% of a block's largest value at int8) becomes ~0.002%, below what moves a greedy choice on
// SmolLM2 where int8 does (docs/quantization.md). Integer dots are exact in any order, so every
// path below gives the same bits for a row whatever the batch, at either width.
// Why: decode streams every weight once per step; 4.5-8.5 bits per weight instead of 32 means
// 4-7x fewer bytes, and int8 dots do 32 multiply-adds per instruction.
// The int8 dot is AVX-512 VNNI (vpdpbusd) where the compiler targets it (-march=native), else
// AVX2 (vpmaddubsw + vpmaddwd), else scalar. Work is split over groups of 8 output rows
// (at::parallel_for); one activation row (decode) reads each group straight from the file layout,
// several rows (batched decode, prefill) share each group decoded once into an interleaved panel
// (panel_rows: the int8 products land in their output lane, no horizontal sums).
// Only the headers used (not torch/extension.h), as in core/radixserve/csrc/gemm.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RS_HAVE_AVX2 1
#else
#define RS_HAVE_AVX2 0
#endif
#if RS_HAVE_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(RS_NO_VNNI)
#define RS_HAVE_VNNI 1
#else
#define RS_HAVE_VNNI 0
#endif

// The M > 1 tile: activation rows per call and groups of 8 weight rows per decoded panel: 4 x 2,
// measured best of 2-8 x 1-4 on Zen 4 (AVX-512 VL) for both activation widths with the rows-inner
// step of panel_rows (AVX2-only machines: not measured since that loop order; macros for A/B builds).
#ifndef RS_PANEL_ROWS
#define RS_PANEL_ROWS 4
#endif
#ifndef RS_PANEL_GROUPS
#define RS_PANEL_GROUPS 2
#endif
namespace {

constexpr int64_t QK = 32;  // inputs per block
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // GGML type ids

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: TORCH_CHECK(false, "gguf_blocks: unsupported GGML type id ", qtype, " (supported: 2 Q4_0, 3 Q4_1, 8 Q8_0)");
  }
  return 0;
}

inline float f16_to_f32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if RS_HAVE_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = man;
      do { m <<= 1; ++e; } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Activation rows quantized per block: codes XT (int8 or int16) [M, K], dx and sx fp32 [M, K / 32].
template <typename XT>
struct QuantizedRows {
  std::vector<XT> q;
  std::vector<float> d, s;
};

// A run of quantized rows: codes [rows, K], scales and sums [rows, K / 32].
template <typename XT>
struct Rows {
  const XT* q;
  const float *d, *s;
};

template <typename XT>
void quantize_rows(const float* x, int64_t lda, int64_t M, int64_t K, QuantizedRows<XT>& out) {
  constexpr float kMax = sizeof(XT) == 1 ? 127.f : 32767.f;
  const int64_t nb = K / QK;
  out.q.resize(M * K);
  out.d.resize(M * nb);
  out.s.resize(M * nb);
  // Decode-sized batches quantize on the calling thread: a parallel region of its own would add a
  // second barrier to every linear, and on a loaded machine a barrier waits for a descheduled
  // thread (Engine offline runs on 2 shared cores measured that, not the kernel, as the cost).
  const int64_t grain = M * K <= (int64_t{1} << 18) ? M * nb : 64;
  at::parallel_for(0, M * nb, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, b = i % nb;
      const float* src = x + r * lda + b * QK;
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float d = amax / kMax, inv = amax > 0.f ? kMax / amax : 0.f;
      XT* q = out.q.data() + r * K + b * QK;
      int sum = 0;
      for (int j = 0; j < QK; ++j) {
        const int v = static_cast<int>(std::nearbyint(src[j] * inv));
        q[j] = static_cast<XT>(v);
        sum += v;
      }
      out.d[i] = d;
      out.s[i] = d * static_cast<float>(sum);
    }
  });
}

#if RS_HAVE_AVX2
// 8 int32 partial sums of u[i] * s[i] over 32 bytes (u unsigned, s signed; no saturation here:
// |u| <= 128 and |s| <= 127 keep each pair within int16).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if RS_HAVE_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

#if RS_HAVE_AVX2
// The 32 codes of one block as bytes: Q4 as 0..15 (unsigned), Q8_0 as int8.
template <int QT>
inline __m256i block_codes(const uint8_t* blk) {
  if constexpr (QT == Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == Q4_1 ? 4 : 2)));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);  // inputs 0-15 | 16-31
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
  }
}

// 8 int32 partial sums of the int16 products w[i] * x[i] over 16 lanes, added to acc (exact:
// |w| <= 127 and |x| <= 32767 keep each pair's sum within int32).
inline __m256i dot_i16(__m256i acc, __m256i w, __m256i x) {
#if RS_HAVE_VNNI
  return _mm256_dpwssd_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

// One weight block's codes decoded once, for dots with activation codes of type XT: the 8 int32
// partial sums of the block's 32 products (any two of them sum to the same exact block dot).
template <int QT, typename XT>
struct BlockCodes;

template <int QT>
struct BlockCodes<QT, int8_t> {
  __m256i w, wabs;  // wabs: |w|, Q8_0 only (vpdpbusd takes one unsigned operand: w's sign moves onto x)
  explicit BlockCodes(const uint8_t* blk) : w(block_codes<QT>(blk)) {
    if constexpr (QT == Q8_0) wabs = _mm256_sign_epi8(w, w);
  }
  __m256i dot(const int8_t* x) const {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    if constexpr (QT == Q8_0) return dot_u8s8(wabs, _mm256_sign_epi8(xv, w));
    return dot_u8s8(w, xv);
  }
};

template <int QT>
struct BlockCodes<QT, int16_t> {
  __m256i lo, hi;  // the codes of inputs 0-15 and 16-31 as int16
  explicit BlockCodes(const uint8_t* blk) {
    if constexpr (QT == Q8_0) {
      lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
      hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
    } else {  // each nibble byte widened to 16 bits: its low nibble is input j, its high one input j + 16
      const auto* nibbles = reinterpret_cast<const __m128i*>(blk + (QT == Q4_1 ? 4 : 2));
      const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(nibbles));
      lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
      hi = _mm256_srli_epi16(bytes, 4);
    }
  }
  __m256i dot(const int16_t* x) const {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
    return dot_i16(dot_i16(_mm256_setzero_si256(), lo, x0), hi, x1);
  }
};

// out[r] = dot(weight row, activation row r) for R rows at once: each weight block is decoded
// once and used from registers by every row. Per block the int32 dot is summed exactly, then
// acc = fma(dot, dw * dx, acc); acc = fma(coef, sx, acc): the same fp32 operations, in the same
// order, as each lane of group8_direct and panel_rows, so a row's result does not depend on the batch around it.
inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

template <int QT, typename XT, int R>
inline void rows_dot(const uint8_t* wrow, int64_t nb, const XT* xq, int64_t K, const float* xd, const float* xs,
                     float* out, int64_t ldo) {
  constexpr int64_t BB = QT == Q8_0 ? 34 : QT == Q4_1 ? 20 : 18;
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * BB;
    const float dw = f16_to_f32(blk);
    const BlockCodes<QT, XT> codes(blk);
    const float coef = QT == Q4_0 ? -8.f * dw : QT == Q4_1 ? f16_to_f32(blk + 2) : 0.f;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i dot = codes.dot(xq + r * K + b * QK);
      acc[r] = std::fma(static_cast<float>(hsum_i32(dot)), dw * xd[r * nb + b], acc[r]);
      if constexpr (QT != Q8_0) acc[r] = std::fma(coef, xs[r * nb + b], acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
}
#endif

#if RS_HAVE_AVX2
// Sum each of eight int32 vectors: lane j of the result = sum of p[j].
inline __m256i reduce8(const __m256i* p) {
  const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
  const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Several activation rows (M > 1): weight rows are decoded G * 8 at a time into `Panel`, a
// per-thread scratch in a "4 inputs x 8 rows" interleave: for block b, group g and step s, one
// 32-byte vector holds, for each of the group's 8 weight rows j, its codes of inputs 4s..4s+3.
// An activation row then needs, per step, one broadcast of its 4 codes and one vpmaddubsw per
// group: the int8 products land in the lane of their output column, so no horizontal sums (the
// cost that made the 8-row dot slower than the fp32 GEMM at batch sizes). The decoded panel is
// reused by every activation row of the call (a chunk of them stays in L2 while it is used).
// Q4: the 16-bit lanes sum 16 products of at most 15 * 127 over a block (30480, no saturation);
// Q8_0 stores |w| and w (its sign is moved onto x) and widens to 32 bits every step.
// int16 activations: a vector holds 2 inputs x 8 rows of int16 codes (16 steps per block), an
// activation row broadcasts its 2 codes per step, and vpdpwssd / vpmaddwd sums into 32 bits.
// Per output lane the fp32 arithmetic is group8_direct's and rows_dot's (one exact int32 dot per
// block, then fma(dot, dw * dx, acc), fma(coef, sx, acc)): the same bits for a row alone or in
// any batch, by any path.
template <typename XT>
struct Panel {
  static constexpr int kSteps = sizeof(XT) == 1 ? 8 : 16;  // 32-byte vectors per block and group
  std::vector<uint8_t> codes, abs_codes;  // [nb][G][kSteps][32]; abs_codes: Q8_0 with int8 only
  std::vector<float> d8, c8;              // [nb][G][8]
  Panel(int64_t nb, int64_t groups, bool q8)
      : codes(nb * groups * kSteps * 32), abs_codes(q8 && sizeof(XT) == 1 ? nb * groups * 8 * 32 : 0),
        d8(nb * groups * 8), c8(nb * groups * 8) {}
};

// 8 x 8 transpose of 32-bit elements: in[j] holds row j's 8 dwords; out[s] holds dword s of rows 0..7.
inline void transpose8x8_epi32(const __m256i* in, __m256i* out) {
  const __m256i t0 = _mm256_unpacklo_epi32(in[0], in[1]), t1 = _mm256_unpackhi_epi32(in[0], in[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(in[2], in[3]), t3 = _mm256_unpackhi_epi32(in[2], in[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(in[4], in[5]), t5 = _mm256_unpackhi_epi32(in[4], in[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(in[6], in[7]), t7 = _mm256_unpackhi_epi32(in[6], in[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  out[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  out[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  out[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  out[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  out[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  out[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  out[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  out[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// Decode weight rows [n0, n0 + 8 * groups) into the panel.
template <int QT, typename XT>
inline void decode_panel(const uint8_t* wp, int64_t row_bytes, int64_t n0, int64_t groups, int64_t nb, Panel<XT>& p) {
  constexpr int64_t BB = QT == Q8_0 ? 34 : QT == Q4_1 ? 20 : 18;
  constexpr int S = Panel<XT>::kSteps;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk0 = wp + (n0 + 8 * g) * row_bytes + b * BB;
      __m256i rows[8], rows_hi[8], steps[16];
      for (int j = 0; j < 8; ++j) {
        const uint8_t* blk = blk0 + j * row_bytes;
        const float dw = f16_to_f32(blk);
        p.d8[(b * groups + g) * 8 + j] = dw;
        p.c8[(b * groups + g) * 8 + j] = QT == Q4_0 ? -8.f * dw : QT == Q4_1 ? f16_to_f32(blk + 2) : 0.f;
        if constexpr (sizeof(XT) == 1) {
          rows[j] = block_codes<QT>(blk);
        } else {
          const BlockCodes<QT, int16_t> codes(blk);
          rows[j] = codes.lo;
          rows_hi[j] = codes.hi;
        }
      }
      transpose8x8_epi32(rows, steps);
      if constexpr (sizeof(XT) == 2) transpose8x8_epi32(rows_hi, steps + 8);
      __m256i* out = reinterpret_cast<__m256i*>(p.codes.data() + (b * groups + g) * S * 32);
      for (int s = 0; s < S; ++s) _mm256_storeu_si256(out + s, steps[s]);
      if constexpr (QT == Q8_0 && sizeof(XT) == 1) {
        __m256i* abs_out = reinterpret_cast<__m256i*>(p.abs_codes.data() + (b * groups + g) * 8 * 32);
        for (int s = 0; s < 8; ++s) _mm256_storeu_si256(abs_out + s, _mm256_sign_epi8(steps[s], steps[s]));
      }
    }
  }
}

// One step of a panel block for one activation row and one group: sum += the products of the
// row's codes at this step (broadcast in xv) with the group's panel vector w (|w| in wabs: Q8_0 with
// int8 codes). int8 Q4 without VNNI sums in 16 bits (exact, see Panel) until `step_total`.
template <int QT, typename XT>
inline __m256i panel_step(__m256i sum, __m256i w, [[maybe_unused]] __m256i wabs, __m256i xv) {
  if constexpr (sizeof(XT) == 2) {
    return dot_i16(sum, w, xv);
  } else {
#if RS_HAVE_VNNI  // 32-bit sums straight from vpdpbusd
    if constexpr (QT == Q8_0) return _mm256_dpbusd_epi32(sum, wabs, _mm256_sign_epi8(xv, w));
    return _mm256_dpbusd_epi32(sum, w, xv);
#else
    if constexpr (QT == Q8_0)
      return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, w)),
                                                     _mm256_set1_epi16(1)));
    return _mm256_add_epi16(sum, _mm256_maddubs_epi16(w, xv));
#endif
  }
}

// A block's 8 int32 dots (one per weight row of the group) from panel_step's sums.
template <int QT, typename XT>
inline __m256i step_total(__m256i sum) {
  if constexpr (sizeof(XT) == 1 && QT != Q8_0 && !RS_HAVE_VNNI) return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
  return sum;
}

// out[r * ldo + 8 * g + j] for R activation rows, G groups of 8 weight rows, from the panel. Per
// step the G panel vectors are loaded once and used by all R rows (each broadcasting its codes of
// the step: 4 int8 or 2 int16), so a step costs G loads + R broadcasts + R * G multiply-adds (rows
// outer, the panel was reloaded for every row, and those loads bound the kernel). The R * G integer
// sums and as many fp32 accumulators want AVX-512 VL's 32 vector registers; AVX2's 16 spill some.
template <int QT, typename XT, int R, int G>
inline void panel_rows(const Panel<XT>& p, int64_t nb, const XT* xq, int64_t K, const float* xd, const float* xs,
                       float* out, int64_t ldo) {
  constexpr int S = Panel<XT>::kSteps, kPerStep = 4 / sizeof(XT);
  constexpr bool kAbs = QT == Q8_0 && sizeof(XT) == 1;
  __m256 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i* w = reinterpret_cast<const __m256i*>(p.codes.data() + b * G * S * 32);
    const __m256i* wabs = reinterpret_cast<const __m256i*>(p.abs_codes.data() + (kAbs ? b * G * S * 32 : 0));
    __m256i sum[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) sum[r][g] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      __m256i wv[G], wa[G];
      for (int g = 0; g < G; ++g) {
        wv[g] = _mm256_loadu_si256(w + g * S + s);
        wa[g] = kAbs ? _mm256_loadu_si256(wabs + g * S + s) : wv[g];
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t codes;
        std::memcpy(&codes, xq + r * K + b * QK + kPerStep * s, 4);
        const __m256i xv = _mm256_set1_epi32(codes);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) sum[r][g] = panel_step<QT, XT>(sum[r][g], wv[g], wa[g], xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
      const __m256 sx = _mm256_set1_ps(xs[r * nb + b]);
      for (int g = 0; g < G; ++g) {
        const __m256i dot = step_total<QT, XT>(sum[r][g]);
        const __m256 d8 = _mm256_loadu_ps(p.d8.data() + (b * G + g) * 8);
        acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d8, dx), acc[r][g]);
        if constexpr (QT != Q8_0)
          acc[r][g] = _mm256_fmadd_ps(_mm256_loadu_ps(p.c8.data() + (b * G + g) * 8), sx, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(out + r * ldo + 8 * g, acc[r][g]);
}
#endif

#if RS_HAVE_AVX2
// The 8 fp16 values at p, p + stride, ..., p + 7 * stride as fp32 (one per weight row of a group).
inline __m256 gather8_f16(const uint8_t* p, int64_t stride) {
  auto h = [&](int j) { uint16_t v; std::memcpy(&v, p + j * stride, 2); return static_cast<int>(v); };
  __m128i v = _mm_cvtsi32_si128(h(0));
  v = _mm_insert_epi16(v, h(1), 1);
  v = _mm_insert_epi16(v, h(2), 2);
  v = _mm_insert_epi16(v, h(3), 3);
  v = _mm_insert_epi16(v, h(4), 4);
  v = _mm_insert_epi16(v, h(5), 5);
  v = _mm_insert_epi16(v, h(6), 6);
  v = _mm_insert_epi16(v, h(7), 7);
  return _mm256_cvtph_ps(v);
}

// One activation row against 8 weight rows read straight from the file layout (batch-1 decode):
// per block the 8 rows' dots are reduced into one vector and scaled with the rows' scales and
// offsets 8 lanes at a time, the same fp32 operations per lane as panel_rows and rows_dot (so a
// row's result does not depend on the path or the batch) at about half rows_dot's instructions
// (no per-block horizontal sum, no scalar fp16 conversions). out[j] for j < 8.
template <int QT, typename XT>
inline void group8_direct(const uint8_t* wrow0, int64_t row_bytes, int64_t nb, const XT* xq, const float* xd,
                          const float* xs, float* out) {
  constexpr int64_t BB = QT == Q8_0 ? 34 : QT == Q4_1 ? 20 : 18;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk0 = wrow0 + b * BB;
    __m256i p[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      // the next group's rows, a group ahead: 8 rows in lockstep are 8 streams for the prefetcher
      _mm_prefetch(reinterpret_cast<const char*>(blk0 + (j + 8) * row_bytes), _MM_HINT_T0);
      p[j] = BlockCodes<QT, XT>(blk0 + j * row_bytes).dot(xq + b * QK);
    }
    const __m256 d8 = gather8_f16(blk0, row_bytes);
    const __m256 dots = _mm256_cvtepi32_ps(reduce8(p));
    acc = _mm256_fmadd_ps(dots, _mm256_mul_ps(d8, _mm256_set1_ps(xd[b])), acc);
    if constexpr (QT == Q4_1) acc = _mm256_fmadd_ps(gather8_f16(blk0 + 2, row_bytes), _mm256_set1_ps(xs[b]), acc);
    if constexpr (QT == Q4_0) acc = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(-8.f)), _mm256_set1_ps(xs[b]), acc);
  }
  _mm256_storeu_ps(out, acc);
}
#endif

// Scalar reference of rows_dot, one activation row (no AVX2).
template <typename XT>
inline float row_dot_scalar(const uint8_t* wrow, int64_t qtype, int64_t nb, const XT* xq, const float* xd,
                            const float* xs) {
  const int64_t bb = block_bytes(qtype);
  float acc = 0.f, offset = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * bb;
    const float dw = f16_to_f32(blk);
    int dot = 0;
    for (int j = 0; j < QK; ++j) {
      int q;
      if (qtype == Q8_0) q = static_cast<int8_t>(blk[2 + j]);
      else {
        const uint8_t byte = blk[(qtype == Q4_1 ? 4 : 2) + (j & 15)];
        q = j < 16 ? byte & 0x0f : byte >> 4;
      }
      dot += q * xq[b * QK + j];
    }
    acc += static_cast<float>(dot) * dw * xd[b];
    if (qtype == Q4_0) offset -= 8.f * dw * xs[b];
    if (qtype == Q4_1) offset += f16_to_f32(blk + 2) * xs[b];
  }
  return acc + offset;
}

#if RS_HAVE_AVX2
// All M activation rows against one decoded panel, RS_PANEL_ROWS rows at a time.
template <int QT, typename XT, int G>
inline void panel_all_rows(const Panel<XT>& p, int64_t nb, const Rows<XT>& x, int64_t M, int64_t K, float* yp,
                           int64_t N) {
  int64_t r = 0;
  for (; r + RS_PANEL_ROWS <= M; r += RS_PANEL_ROWS)
    panel_rows<QT, XT, RS_PANEL_ROWS, G>(p, nb, x.q + r * K, K, x.d + r * nb, x.s + r * nb, yp + r * N, N);
  for (; r < M; ++r)
    panel_rows<QT, XT, 1, G>(p, nb, x.q + r * K, K, x.d + r * nb, x.s + r * nb, yp + r * N, N);
}
#endif

// y[:, n] for the output rows [begin, end), all M activation rows: one row reads the file layout
// directly (group8_direct); several rows share decoded panels; rows_dot takes the last < 8 rows.
template <int QT, typename XT>
void linear_rows(const uint8_t* wp, int64_t row_bytes, int64_t begin, int64_t end, const Rows<XT>& x, int64_t M,
                 int64_t K, float* yp, int64_t N) {
  const int64_t nb = K / QK;
  int64_t n = begin;
#if RS_HAVE_AVX2
  if (M == 1) {
    for (; n + 8 <= end; n += 8) group8_direct<QT, XT>(wp + n * row_bytes, row_bytes, nb, x.q, x.d, x.s, yp + n);
  } else {
    constexpr int64_t G = RS_PANEL_GROUPS;
    Panel<XT> panel(nb, G, QT == Q8_0);
    for (; n + 8 * G <= end; n += 8 * G) {
      decode_panel<QT, XT>(wp, row_bytes, n, G, nb, panel);
      panel_all_rows<QT, XT, G>(panel, nb, x, M, K, yp + n, N);
    }
    if (n + 8 <= end) {
      Panel<XT> one(nb, 1, QT == Q8_0);
      decode_panel<QT, XT>(wp, row_bytes, n, 1, nb, one);
      panel_all_rows<QT, XT, 1>(one, nb, x, M, K, yp + n, N);
      n += 8;
    }
  }
#endif
  for (; n < end; ++n) {
    const uint8_t* wrow = wp + n * row_bytes;
    int64_t r = 0;
#if RS_HAVE_AVX2
    for (; r + 4 <= M; r += 4)
      rows_dot<QT, XT, 4>(wrow, nb, x.q + r * K, K, x.d + r * nb, x.s + r * nb, yp + r * N + n, N);
    for (; r < M; ++r)
      rows_dot<QT, XT, 1>(wrow, nb, x.q + r * K, K, x.d + r * nb, x.s + r * nb, yp + r * N + n, N);
#else
    for (; r < M; ++r)
      yp[r * N + n] = row_dot_scalar(wrow, QT, nb, x.q + r * K, x.d + r * nb, x.s + r * nb);
#endif
  }
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(K % QK == 0, "gguf_blocks: input size ", K, " is not a multiple of 32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "gguf_blocks: weight uint8 [N, bytes]");
  TORCH_CHECK(w.size(1) == K / QK * block_bytes(qtype), "gguf_blocks: weight rows hold ", w.size(1),
              " bytes, type ", qtype, " with K = ", K, " needs ", K / QK * block_bytes(qtype));
}

// Exactly gguf.quants.dequantize: products and sums as separate fp32 roundings (no FMA contraction).
__attribute__((optimize("fp-contract=off"))) void dequantize_row(const uint8_t* row, int64_t qtype, int64_t K,
                                                                  float* out) {
  const int64_t bb = block_bytes(qtype);
  for (int64_t b = 0; b < K / QK; ++b) {
    const uint8_t* blk = row + b * bb;
    const float d = f16_to_f32(blk);
    float* o = out + b * QK;
    if (qtype == Q8_0) {
      for (int j = 0; j < QK; ++j) o[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
    } else if (qtype == Q4_0) {
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>((blk[2 + j] & 0x0f) - 8);
        o[j + 16] = d * static_cast<float>((blk[2 + j] >> 4) - 8);
      }
    } else {
      const float m = f16_to_f32(blk + 2);
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>(blk[4 + j] & 0x0f) + m;
        o[j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
      }
    }
  }
}

// y [M, N] = x [M, K] @ W^T over activation codes of type XT (the body of `linear`).
template <typename XT>
void linear_into(const at::Tensor& x, const at::Tensor& w, int64_t qtype, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  QuantizedRows<XT> xq;
  quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, xq);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  float* yp = y.data_ptr<float>();
  // Row chunks whose activation codes stay in L2 while every weight panel passes them (a decode
  // batch is one chunk); within a chunk, tasks over groups of 8 output rows (the kernels' unit; only
  // the last group is partial), at least 2 groups per task so that a thread streams a contiguous
  // run of the weight (each panel is decoded once per chunk).
  const int64_t nb = K / QK, chunk = std::max<int64_t>(4, (256 * 1024 / (K * sizeof(XT))) / 4 * 4);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    const Rows<XT> xr{xq.q.data() + m0 * K, xq.d.data() + m0 * nb, xq.s.data() + m0 * nb};
    float* yc = yp + m0 * N;
    at::parallel_for(0, (N + 7) / 8, 2, [&](int64_t group_begin, int64_t group_end) {
      const int64_t begin = group_begin * 8, end = std::min(group_end * 8, N);
      switch (qtype) {
        case Q4_0: linear_rows<Q4_0, XT>(wp, row_bytes, begin, end, xr, rows, K, yc, N); break;
        case Q4_1: linear_rows<Q4_1, XT>(wp, row_bytes, begin, end, xr, rows, K, yc, N); break;
        default: linear_rows<Q8_0, XT>(wp, row_bytes, begin, end, xr, rows, K, yc, N); break;
      }
    });
  }
}

}  // namespace

// x fp32 [..., K] (a [M, K] matrix with contiguous rows, or any contiguous tensor), w blocks
// [N, K/32 * block bytes] of `qtype`; the activations quantized per 32-block to `act_bits` (8 or
// 16) bits. Returns fp32 [..., N]. (The reshape is here, not in Python: at batch 1 the wrapper's
// tensor calls cost a visible share of a decode step.)
at::Tensor linear(at::Tensor x_in, at::Tensor w, int64_t qtype, int64_t act_bits) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat, "gguf_blocks.linear: x fp32 [..., K]");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "gguf_blocks.linear: act_bits must be 8 or 16, got ", act_bits);
  const bool matrix = x_in.dim() == 2 && x_in.stride(1) == 1;
  const at::Tensor x = matrix ? x_in : x_in.contiguous().view({-1, x_in.size(-1)});
  check_weight(w, qtype, x.size(1));
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = w.size(0);
  auto y = at::empty(out_shape, x.options());
  if (act_bits == 8)
    linear_into<int8_t>(x, w, qtype, y);
  else
    linear_into<int16_t>(x, w, qtype, y);
  return y;
}

// fp32 [N, K]: every row dequantized (bit-exact with gguf.quants.dequantize).
at::Tensor dequantize(at::Tensor w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const int64_t N = w.size(0), row_bytes = w.size(1);
  auto out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) dequantize_row(wp + n * row_bytes, qtype, K, op + n * K);
  });
  return out;
}

// fp32 [T, K]: rows `ids` (int64 [T], each in [0, N)) of the weight, dequantized: an embedding
// lookup straight from the blocks.
at::Tensor embedding(at::Tensor ids, at::Tensor w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(), "gguf_blocks.embedding: ids int64 [T]");
  const int64_t T = ids.size(0), N = w.size(0), row_bytes = w.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "gguf_blocks.embedding: id ", ip[t], " outside [0, ", N, ")");
  auto out = at::empty({T, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) dequantize_row(wp + ip[t] * row_bytes, qtype, K, op + t * K);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", [] { return std::string(RS_HAVE_VNNI ? "avx512_vnni" : RS_HAVE_AVX2 ? "avx2" : "scalar"); },
        "the integer dot products this build uses");
  m.def("block_bytes", &block_bytes, "bytes per 32-input block of a GGML type id");
  m.def("linear", &linear, "x @ W^T with W kept in GGUF blocks (int8 or int16 activations per 32-block)");
  m.def("dequantize", &dequantize, "all rows of a block weight as fp32");
  m.def("embedding", &embedding, "the given rows of a block weight as fp32");
}
