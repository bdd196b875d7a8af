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
// Why: decode streams every weight once per step; 4.5-8.5 bits per weight instead of 32 means
// 4-7x fewer bytes, and int8 dots do 32 multiply-adds per instruction.
// The int8 dot is AVX-512 VNNI (vpdpbusd) where the compiler targets it (-march=native), else
// AVX2 (vpmaddubsw + vpmaddwd), else scalar. Work is split over groups of 8 output rows
// (at::parallel_for); one activation row (decode) reads each group straight from the file layout.
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

// Activation rows quantized per block: codes int8 [M, K], dx and sx fp32 [M, K / 32].
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

void quantize_rows(const float* x, int64_t lda, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t nb = K / QK;
  out.q.resize(M * K);
  out.d.resize(M * nb);
  out.s.resize(M * nb);
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, b = i % nb;
      const float* src = x + r * lda + b * QK;
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* q = out.q.data() + r * K + b * QK;
      int sum = 0;
      for (int j = 0; j < QK; ++j) {
        const int v = static_cast<int>(std::nearbyint(src[j] * inv));
        q[j] = static_cast<int8_t>(v);
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

// out[r] = dot(weight row, activation row r) for R rows at once: each weight block is decoded
// once and used from registers by every row. Per block the int32 dot is summed exactly, then
// acc = fma(dot, dw * dx, acc); acc = fma(coef, sx, acc): the same fp32 operations, in the same
// order, as each lane of group8_dot, so a row's result does not depend on the batch around it.
inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

template <int QT, int R>
inline void rows_dot(const uint8_t* wrow, int64_t nb, const int8_t* xq, int64_t K, const float* xd, const float* xs,
                     float* out, int64_t ldo) {
  constexpr int64_t BB = QT == Q8_0 ? 34 : QT == Q4_1 ? 20 : 18;
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + b * BB;
    const float dw = f16_to_f32(blk);
    const __m256i wv = block_codes<QT>(blk);
    __m256i wabs;
    if constexpr (QT == Q8_0) wabs = _mm256_sign_epi8(wv, wv);
    const float coef = QT == Q4_0 ? -8.f * dw : QT == Q4_1 ? f16_to_f32(blk + 2) : 0.f;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * QK));
      __m256i dot;
      if constexpr (QT == Q8_0)  // signed x signed: move w's sign onto x
        dot = dot_u8s8(wabs, _mm256_sign_epi8(xv, wv));
      else
        dot = dot_u8s8(wv, xv);
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

// Eight weight rows at once (for several activation rows): the rows' codes are decoded once into
// `codes` [nb][8][32] with their scales `d8` and offset coefficients `c8` [nb][8]; then for each
// activation row the eight block dots are reduced into one vector, so the scale and offset
// arithmetic runs eight weight rows per instruction. out[r * ldo + j] for j < 8.
struct Group8 {
  std::vector<uint8_t> codes;
  std::vector<float> d8, c8;
  explicit Group8(int64_t nb) : codes(nb * 8 * QK), d8(nb * 8), c8(nb * 8) {}
};

template <int QT>
inline void decode8(const uint8_t* wrow0, int64_t row_bytes, int64_t nb, Group8& g) {
  constexpr int64_t BB = QT == Q8_0 ? 34 : QT == Q4_1 ? 20 : 18;
  for (int j = 0; j < 8; ++j) {
    const uint8_t* wrow = wrow0 + j * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wrow + b * BB;
      const float dw = f16_to_f32(blk);
      g.d8[b * 8 + j] = dw;
      g.c8[b * 8 + j] = QT == Q4_0 ? -8.f * dw : QT == Q4_1 ? f16_to_f32(blk + 2) : 0.f;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(g.codes.data() + (b * 8 + j) * QK), block_codes<QT>(blk));
    }
  }
}

template <int QT, int R>
inline void group8_dot(const Group8& g, int64_t nb, const int8_t* xq, int64_t K, const float* xd, const float* xs,
                       float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i* w = reinterpret_cast<const __m256i*>(g.codes.data() + b * 8 * QK);
    const __m256 d8 = _mm256_loadu_ps(g.d8.data() + b * 8);
    __m256 c8;
    if constexpr (QT != Q8_0) c8 = _mm256_loadu_ps(g.c8.data() + b * 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * QK));
      __m256i p[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i wv = _mm256_loadu_si256(w + j);
        if constexpr (QT == Q8_0)
          p[j] = dot_u8s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        else
          p[j] = dot_u8s8(wv, xv);
      }
      const __m256 dots = _mm256_cvtepi32_ps(reduce8(p));
      acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(d8, _mm256_set1_ps(xd[r * nb + b])), acc[r]);
      if constexpr (QT != Q8_0) acc[r] = _mm256_fmadd_ps(c8, _mm256_set1_ps(xs[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, acc[r]);
    for (int j = 0; j < 8; ++j) out[r * ldo + j] = tmp[j];
  }
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
// offsets 8 lanes at a time, the same fp32 operations per lane as group8_dot and rows_dot (so a
// row's result does not depend on the path or the batch) at about half rows_dot's instructions
// (no per-block horizontal sum, no scalar fp16 conversions). out[j] for j < 8.
template <int QT>
inline void group8_direct(const uint8_t* wrow0, int64_t row_bytes, int64_t nb, const int8_t* xq, const float* xd,
                          const float* xs, float* out) {
  constexpr int64_t BB = QT == Q8_0 ? 34 : QT == Q4_1 ? 20 : 18;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk0 = wrow0 + b * BB;
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * QK));
    __m256i p[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      // the next group's rows, a group ahead: 8 rows in lockstep are 8 streams for the prefetcher
      _mm_prefetch(reinterpret_cast<const char*>(blk0 + (j + 8) * row_bytes), _MM_HINT_T0);
      const __m256i wv = block_codes<QT>(blk0 + j * row_bytes);
      if constexpr (QT == Q8_0)
        p[j] = dot_u8s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
      else
        p[j] = dot_u8s8(wv, xv);
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
inline float row_dot_scalar(const uint8_t* wrow, int64_t qtype, int64_t nb, const int8_t* xq, const float* xd,
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

// y[:, n] for the output rows [begin, end), all M activation rows, 4 at a time.
template <int QT>
void linear_rows(const uint8_t* wp, int64_t row_bytes, int64_t begin, int64_t end, const QuantizedRows& x, int64_t M,
                 int64_t K, float* yp, int64_t N) {
  const int64_t nb = K / QK;
  int64_t n = begin;
#if RS_HAVE_AVX2
  if (M == 1) {
    for (; n + 8 <= end; n += 8) group8_direct<QT>(wp + n * row_bytes, row_bytes, nb, x.q.data(), x.d.data(), x.s.data(), yp + n);
  } else {
    Group8 g(nb);
    for (; n + 8 <= end; n += 8) {
      decode8<QT>(wp + n * row_bytes, row_bytes, nb, g);
      int64_t r = 0;
      for (; r + 4 <= M; r += 4)
        group8_dot<QT, 4>(g, nb, x.q.data() + r * K, K, x.d.data() + r * nb, x.s.data() + r * nb, yp + r * N + n, N);
      for (; r < M; ++r)
        group8_dot<QT, 1>(g, nb, x.q.data() + r * K, K, x.d.data() + r * nb, x.s.data() + r * nb, yp + r * N + n, N);
    }
  }
#endif
  for (; n < end; ++n) {
    const uint8_t* wrow = wp + n * row_bytes;
    int64_t r = 0;
#if RS_HAVE_AVX2
    for (; r + 4 <= M; r += 4)
      rows_dot<QT, 4>(wrow, nb, x.q.data() + r * K, K, x.d.data() + r * nb, x.s.data() + r * nb, yp + r * N + n, N);
    for (; r < M; ++r)
      rows_dot<QT, 1>(wrow, nb, x.q.data() + r * K, K, x.d.data() + r * nb, x.s.data() + r * nb, yp + r * N + n, N);
#else
    for (; r < M; ++r)
      yp[r * N + n] = row_dot_scalar(wrow, QT, nb, x.q.data() + r * K, x.d.data() + r * nb, x.s.data() + r * nb);
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

}  // namespace

// x fp32 [..., K] (a [M, K] matrix with contiguous rows, or any contiguous tensor), w blocks
// [N, K/32 * block bytes] of `qtype`. Returns fp32 [..., N]. (The reshape is here, not in Python:
// at batch 1 the wrapper's tensor calls cost a visible share of a decode step.)
at::Tensor linear(at::Tensor x_in, at::Tensor w, int64_t qtype) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat, "gguf_blocks.linear: x fp32 [..., K]");
  const bool matrix = x_in.dim() == 2 && x_in.stride(1) == 1;
  const at::Tensor x = matrix ? x_in : x_in.contiguous().view({-1, x_in.size(-1)});
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, qtype, K);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  auto y = at::empty(out_shape, x.options());
  QuantizedRows xq;
  quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, xq);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  float* yp = y.data_ptr<float>();
  // tasks over groups of 8 output rows (the kernels' unit; only the last group is partial),
  // at least 2 groups per task so that a thread streams a contiguous run of the weight
  at::parallel_for(0, (N + 7) / 8, 2, [&](int64_t group_begin, int64_t group_end) {
    const int64_t begin = group_begin * 8, end = std::min(group_end * 8, N);
    switch (qtype) {
      case Q4_0: linear_rows<Q4_0>(wp, row_bytes, begin, end, xq, M, K, yp, N); break;
      case Q4_1: linear_rows<Q4_1>(wp, row_bytes, begin, end, xq, M, K, yp, N); break;
      default: linear_rows<Q8_0>(wp, row_bytes, begin, end, xq, M, K, yp, N); break;
    }
  });
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
        "the int8 dot product this build uses");
  m.def("block_bytes", &block_bytes, "bytes per 32-input block of a GGML type id");
  m.def("linear", &linear, "x @ W^T with W kept in GGUF blocks (int8 activations per 32-block)");
  m.def("dequantize", &dequantize, "all rows of a block weight as fp32");
  m.def("embedding", &embedding, "the given rows of a block weight as fp32");
}
