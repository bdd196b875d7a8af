// Tiled (flash) extend attention with bf16 products, for long prompts and chunks (included by
// attention.cpp inside its anonymous namespace, after the helpers it uses: bf16_bits, TaskCost...).
//
// Why: the per-query-row extend of attention.cpp reads every key once per block of 16 queries and
// reduces each score across lanes; on a 4,000-token prompt that, or torch's SDPA (~135 GFLOP/s on
// two Zen 4 cores), made attention two thirds of the prefill. Here a task is one request's block of
// 16 * QV queries for a few query heads of one KV group (NV = heads x QV vectors of 16 query rows, the
// rows in the lanes; flash_shape), and keys come in blocks of kFlashKeys:
//   1. scores S[key][row vector] by vdpbf16ps: the rows' bf16 query words (transposed once per task)
//      times each key's word broadcast straight from the pool row (no packing of K);
//   2. an online softmax per lane (running max and sum, the earlier value sums rescaled), with the
//      causal / window mask on the blocks that need it, elementwise since rows are lanes;
//   3. the value sums O[row] += P[row][key] V[key] by vdpbf16ps: the block's value rows interleaved
//      in pairs once (as values_nh_bf16 does), each row's bf16 weight pair broadcast.
// Numerics (runtime.cpu_matmul_precision=medium): queries and softmax weights rounded to bf16, fp32
// sums, the 1 / sum of the fp32 weights; weights are relative to the running max, so they are rounded
// before the later rescale (a rounding per block, not per prompt, of the same size as the per-row
// kernel's). Speculative verifies never come here (trees keep the per-row kernel, whose bits equal
// decode's); a cap (soft-capping) is applied per score in scalar code (Gemma 2 only).
#if RS_ATTN_BF16_PRODUCTS

constexpr int64_t kFlashKeys = 64;        // keys per block: S and P for NV <= 8 vectors stay in L1
constexpr float kMaskedScore = -1e30f;     // a hidden key's score: finite (-ffast-math), exp() of it - max is 0
constexpr int kFlashMaxVectors = 8;        // row vectors per task (heads x query sub-blocks)

// exp(x) for x <= 0 in 16 lanes: exp_nonpositive's method and constants (exactly 0 below -87).
inline __m512 exp16_nonpositive(__m512 x) {
  using E = ExpConstants;
  const __m512 lowest = _mm512_set1_ps(E::lowest);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(E::log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(E::ln2_hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(E::ln2_lo), r);
  __m512 p = _mm512_set1_ps(E::poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(E::poly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(two_n)));
}

// One task: request `req`'s new tokens [q_first, q_first + q_count) (request-relative), query heads
// [h_first, h_first + heads) of KV group g, QV vectors of 16 queries per head.
struct FlashTask {
  int64_t req, q_row, q_first, q_count, g, h_first, heads, qv;
};

// The query-block shape for a group of `group` query heads per KV head: (QV, heads per task) with
// heads x QV <= kFlashMaxVectors. Few vectors and many keys per score call are faster (each key word
// broadcast feeds fewer accumulators, but the query words loaded per step are fewer too): 9/3 heads of
// 64 at 2,048 tokens, 3 vectors x 8 keys 308 GFLOP/s against 6 x 4 263 (session 21).
inline std::pair<int64_t, int64_t> flash_shape(int64_t group) {
  if (group == 1) return {2, 1};
  return {1, group % 3 == 0 || group > 4 ? 3 : group};
}

// A thread's buffers for flash tasks, reused.
struct FlashScratch {
  std::vector<uint32_t> qt;   // [D / 2][NV * 16] the rows' bf16 query words, transposed
  std::vector<float> s;       // [kFlashKeys][NV * 16] scores, then weights
  std::vector<uint32_t> pw;   // [kFlashKeys / 2][NV * 16] weight pairs
  std::vector<uint32_t> vp;   // [kFlashKeys / 2][D] the block's value rows interleaved in pairs
  std::vector<float> o;       // [NV * 16][D] value sums (element order of values_nh_bf16's accumulators)
};

// Value sums of MR rows starting at row m0: o[m] = o[m] * corr[m] + sum over the block's pairs of
// pw[pair][m] * vp[pair]; MR * D / 16 accumulators.
template <int D, int MR>
inline void flash_values(int64_t m0, int64_t pairs, int64_t rows_stride, const uint32_t* pw, const uint32_t* vp,
                         const float* corr, float* o) {
  constexpr int A = D / 16;  // accumulators a row: D / 32 chunks, low and high halves
  __m512 acc[MR][A];
  for (int r = 0; r < MR; ++r) {
    const __m512 c = _mm512_set1_ps(corr[m0 + r]);
    for (int a = 0; a < A; ++a) acc[r][a] = _mm512_mul_ps(_mm512_loadu_ps(o + (m0 + r) * D + 16 * a), c);
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh v[A];
    for (int a = 0; a < A; ++a) v[a] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(vp + p * D + 16 * a)));
    for (int r = 0; r < MR; ++r) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pw[p * rows_stride + m0 + r])));
      for (int a = 0; a < A; ++a) acc[r][a] = _mm512_dpbf16_ps(acc[r][a], v[a], w);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int a = 0; a < A; ++a) _mm512_storeu_ps(o + (m0 + r) * D + 16 * a, acc[r][a]);
}

// Rows per flash_values call: their accumulators fill at most 24 registers.
template <int D>
constexpr int kFlashValueRows = D == 64 ? 6 : D == 128 ? 3 : 1;

template <int D>
inline void flash_values_rows(int64_t m0, int64_t count, int64_t pairs, int64_t rows_stride, const uint32_t* pw,
                              const uint32_t* vp, const float* corr, float* o) {
  constexpr int MR = kFlashValueRows<D>;
  int64_t m = m0;
  for (; m + MR <= m0 + count; m += MR) flash_values<D, MR>(m, pairs, rows_stride, pw, vp, corr, o);
  for (; m < m0 + count; ++m) flash_values<D, 1>(m, pairs, rows_stride, pw, vp, corr, o);
}

// Scores of KR keys [t, t + KR) (a missing key reads `zeros`) for NV row vectors: s[key][lanes] =
// scale * (query words . key words), the key's words broadcast from its pool row.
template <int D, int NV, int KR>
inline void flash_scores(const uint32_t* qt, const uint32_t* const* keys, float scale, float* s) {
  __m512 acc[KR][NV];
  for (int k = 0; k < KR; ++k)
    for (int v = 0; v < NV; ++v) acc[k][v] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int j = 0; j < D / 2; ++j) {
    __m512bh q[NV];
    for (int v = 0; v < NV; ++v) q[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(reinterpret_cast<const void*>(qt + (j * NV + v) * 16)));
    for (int k = 0; k < KR; ++k) {
      const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(keys[k][j])));
      for (int v = 0; v < NV; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], q[v], b);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int k = 0; k < KR; ++k)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + (k * NV + v) * 16, _mm512_mul_ps(acc[k][v], sc));
}

// Keys per flash_scores call: KR x NV accumulators, at most 24.
template <int NV>
constexpr int kFlashKeyRows = NV == 1 ? 16 : NV == 2 ? 12 : NV == 3 ? 8 : NV == 4 ? 6 : NV <= 6 ? 4 : 3;

// The task: its rows' softmax-weighted value sums into out (rows q_row + i, heads h_first..).
template <int D, int NV>
void flash_task(const FlashTask& task, const float* q, int64_t width, const bf16_bits* k_buf, const bf16_bits* v_buf,
                int64_t row, const int64_t* slots, int64_t prefix, float scale, const LayerOptions& opt, float* out,
                FlashScratch& scratch) {
  constexpr int KR = kFlashKeyRows<NV>;
  constexpr int M = NV * 16;  // rows (lanes of the NV vectors): vector v = head_local * qv + sub-block
  alignas(64) static const bf16_bits zeros[D] = {};
  scratch.qt.assign(static_cast<size_t>(D / 2 * M), 0u);
  scratch.s.resize(static_cast<size_t>((kFlashKeys + KR) * M));  // the last call of a block may pass its end
  scratch.pw.resize(static_cast<size_t>(kFlashKeys / 2 * M));
  scratch.vp.resize(static_cast<size_t>(kFlashKeys / 2 * D));
  scratch.o.assign(static_cast<size_t>(M * D), 0.f);
  uint32_t* qt = scratch.qt.data();
  float* s = scratch.s.data();
  uint32_t* pw = scratch.pw.data();
  uint32_t* vp = scratch.vp.data();
  float* o = scratch.o.data();
  // rows: lane l of vector v is query q_first + 16 * (v % qv) + l of head h_first + v / qv
  auto query_of = [&](int64_t v, int64_t l) { return 16 * (v % task.qv) + l; };  // within the task
  alignas(64) uint32_t words[D / 2];
  for (int64_t v = 0; v < NV; ++v)
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t i = query_of(v, l);
      if (i >= task.q_count) continue;  // padding rows: zero queries, never written out
      round_query<D>(q + (task.q_row + i) * width + (task.h_first + v / task.qv) * D, words);
      for (int64_t j = 0; j < D / 2; ++j) qt[(j * NV + v) * 16 + l] = words[j];
    }
  // lane positions: a key t is visible to lane (v, l) iff t <= pos and (no window or t > pos - window)
  __m512i pos[NV];
  for (int v = 0; v < NV; ++v)
    pos[v] = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32(static_cast<int>(prefix + task.q_first + 16 * (v % task.qv))));
  const int64_t first_pos = prefix + task.q_first, last_pos = first_pos + task.q_count - 1;
  const int64_t end = last_pos + 1;  // keys [0, end) are visible to some row
  const int64_t begin = opt.window > 0 ? std::max<int64_t>(0, first_pos - opt.window + 1) : 0;
  __m512 run_max[NV], run_sum[NV];
  for (int v = 0; v < NV; ++v) run_max[v] = _mm512_set1_ps(kMaskedScore), run_sum[v] = _mm512_setzero_ps();
  alignas(64) float corr[M];
  const uint32_t* keys[KR];
  for (int64_t t0 = begin; t0 < end; t0 += kFlashKeys) {
    const int64_t n = std::min(kFlashKeys, end - t0);
    const int64_t* bs = slots + t0;
    // 1. scores, KR keys at a time (the next keys' rows prefetched a call ahead)
    for (int64_t k0 = 0; k0 < n; k0 += KR) {
      for (int k = 0; k < KR; ++k) {
        keys[k] = reinterpret_cast<const uint32_t*>(k0 + k < n ? k_buf + bs[k0 + k] * row + task.g * D : zeros);
        if (k0 + KR + k < n) prefetch_row(k_buf + bs[k0 + KR + k] * row + task.g * D, D);
        if (k0 + k < n) prefetch_row(v_buf + bs[k0 + k] * row + task.g * D, D);
      }
      flash_scores<D, NV, KR>(qt, keys, scale, s + k0 * M);
    }
    if (opt.cap > 0.f)
      for (int64_t e = 0; e < n * M; ++e) s[e] = opt.cap * std::tanh(s[e] / opt.cap);
    // 2. the mask where some row cannot see some key of the block, the running max, the weights
    const bool masked = t0 + n - 1 > first_pos || (opt.window > 0 && t0 <= last_pos - opt.window);
    auto visible = [&](int64_t t, int v) -> __mmask16 {
      const __m512i tv = _mm512_set1_epi32(static_cast<int>(t));
      __mmask16 m = _mm512_cmple_epi32_mask(tv, pos[v]);
      if (opt.window > 0)
        m &= _mm512_cmpgt_epi32_mask(tv, _mm512_sub_epi32(pos[v], _mm512_set1_epi32(static_cast<int>(opt.window))));
      return m;
    };
    __m512 block_max[NV];
    for (int v = 0; v < NV; ++v) block_max[v] = run_max[v];
    for (int64_t k = 0; k < n; ++k)
      for (int v = 0; v < NV; ++v) {
        __m512 x = _mm512_loadu_ps(s + (k * NV + v) * 16);
        if (masked) x = _mm512_mask_mov_ps(_mm512_set1_ps(kMaskedScore), visible(t0 + k, v), x);
        block_max[v] = _mm512_max_ps(block_max[v], x);
      }
    for (int v = 0; v < NV; ++v) {
      const __m512 c = exp16_nonpositive(_mm512_sub_ps(run_max[v], block_max[v]));
      _mm512_store_ps(corr + 16 * v, c);
      run_sum[v] = _mm512_mul_ps(run_sum[v], c);
      run_max[v] = block_max[v];
    }
    for (int64_t k = 0; k < n; ++k)
      for (int v = 0; v < NV; ++v) {
        float* sk = s + (k * NV + v) * 16;
        __m512 p = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sk), run_max[v]));
        if (masked) p = _mm512_maskz_mov_ps(visible(t0 + k, v), p);
        run_sum[v] = _mm512_add_ps(run_sum[v], p);
        _mm512_storeu_ps(sk, p);
      }
    // weight pairs (keys 2p, 2p + 1) per row, in row order; the block's value rows in pairs
    const int64_t pairs = (n + 1) / 2;
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t p = 0; p < pairs; ++p) {
      for (int v = 0; v < NV; ++v) {
        const __m512 a = _mm512_loadu_ps(s + (2 * p * NV + v) * 16);
        const __m512 b = 2 * p + 1 < n ? _mm512_loadu_ps(s + ((2 * p + 1) * NV + v) * 16) : _mm512_setzero_ps();
        const __m512i w = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));  // a's 16 bf16, then b's
        _mm512_storeu_si512(reinterpret_cast<void*>(pw + p * M + 16 * v), _mm512_permutexvar_epi16(interleave, w));
      }
      const bf16_bits* va = v_buf + bs[2 * p] * row + task.g * D;
      const bf16_bits* vb = 2 * p + 1 < n ? v_buf + bs[2 * p + 1] * row + task.g * D : zeros;
      for (int c = 0; c < D / 32; ++c) {
        const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(va + 32 * c));
        const __m512i y = _mm512_loadu_si512(reinterpret_cast<const void*>(vb + 32 * c));
        _mm512_storeu_si512(reinterpret_cast<void*>(vp + p * D + 32 * c), _mm512_unpacklo_epi16(x, y));
        _mm512_storeu_si512(reinterpret_cast<void*>(vp + p * D + 32 * c + 16), _mm512_unpackhi_epi16(x, y));
      }
    }
    // 3. the value sums of the rows that exist (whole vectors of padding skipped)
    for (int v = 0; v < NV; ++v) {
      const int64_t rows_here = std::min<int64_t>(16, task.q_count - 16 * (v % task.qv));
      if (rows_here > 0) flash_values_rows<D>(16 * v, rows_here, pairs, M, pw, vp, corr, o);
    }
  }
  // out = o / sum, in element order (o holds values_nh_bf16's accumulator order)
  alignas(64) float inv[M];
  for (int v = 0; v < NV; ++v) _mm512_store_ps(inv + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.f), run_sum[v]));
  for (int v = 0; v < NV; ++v)
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t i = query_of(v, l);
      if (i >= task.q_count) continue;
      const int64_t m = 16 * v + l;
      const __m512 scale_row = _mm512_set1_ps(inv[m]);
      float* dst = out + (task.q_row + i) * width + (task.h_first + v / task.qv) * D;
      for (int c = 0; c < D / 32; ++c) {
        const __m512 lo = _mm512_loadu_ps(o + m * D + 32 * c), hi = _mm512_loadu_ps(o + m * D + 32 * c + 16);
        const __m512 first = _mm512_shuffle_f32x4(lo, hi, 0x44), second = _mm512_shuffle_f32x4(lo, hi, 0xee);
        _mm512_storeu_ps(dst + 32 * c, _mm512_mul_ps(_mm512_shuffle_f32x4(first, first, 0xd8), scale_row));
        _mm512_storeu_ps(dst + 32 * c + 16, _mm512_mul_ps(_mm512_shuffle_f32x4(second, second, 0xd8), scale_row));
      }
    }
}

// flash_task for the task's vector count (heads x qv, 1..kFlashMaxVectors).
template <int D>
void flash_task_any(const FlashTask& task, const float* q, int64_t width, const bf16_bits* k_buf,
                    const bf16_bits* v_buf, int64_t row, const int64_t* slots, int64_t prefix, float scale,
                    const LayerOptions& opt, float* out, FlashScratch& scratch) {
  auto run = [&](auto nv) {
    flash_task<D, decltype(nv)::value>(task, q, width, k_buf, v_buf, row, slots, prefix, scale, opt, out, scratch);
  };
  switch (task.heads * task.qv) {  // 1..kFlashMaxVectors: checked where the tasks are made (run_extend)
    case 1: run(std::integral_constant<int, 1>()); break;
    case 2: run(std::integral_constant<int, 2>()); break;
    case 3: run(std::integral_constant<int, 3>()); break;
    case 4: run(std::integral_constant<int, 4>()); break;
    case 5: run(std::integral_constant<int, 5>()); break;
    case 6: run(std::integral_constant<int, 6>()); break;
    case 7: run(std::integral_constant<int, 7>()); break;
    case 8: run(std::integral_constant<int, 8>()); break;
  }
}

#endif  // RS_ATTN_BF16_PRODUCTS
