// Decode attention straight from the token-slot KV pool (fp32, CPU).
//
// Why: the torch path gathers every request's K and V into a padded tensor each layer and then runs
// SDPA over it; at batch 64 that copy and SDPA's per-(request, head) set-up cost more than the math.
// Here each (request, KV head) task reads its keys and values in place through the request's slot
// row and serves all query heads of its GQA group with one pass over them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kPrefetchAhead = 8;  // slots: far enough to hide a DRAM miss, near enough to stay cached

inline void prefetch_row(const float* row, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(row + i, 0, 1);
}

// One request: every query head attends over `len` keys at `slots`; the query heads of a KV head's
// group share its keys. A task covers whole slot rows (all KV heads) so each row is read once.
template <int D>
void attend_request(const float* q, int64_t hq, int64_t hkv, const float* k_buf, const float* v_buf,
                    const int64_t* slots, int64_t len, float scale, float* out, std::vector<float>& scores) {
  const int64_t group = hq / hkv, row = hkv * D;
  scores.resize(static_cast<size_t>(hq * len));
  float* s = scores.data();
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_row(k_buf + slots[t + kPrefetchAhead] * row, row);
    const float* k_row = k_buf + slots[t] * row;
    for (int64_t h = 0; h < hq; ++h) {
      const float* qh = q + h * D;
      const float* k = k_row + (h / group) * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int j = 0; j < D; ++j) acc += qh[j] * k[j];
      s[h * len + t] = acc * scale;
    }
  }
  float inv_sum[64];
  for (int64_t h = 0; h < hq; ++h) {
    float* sh = s + h * len;
    float m = -INFINITY;
    for (int64_t t = 0; t < len; ++t) m = std::max(m, sh[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = std::exp(sh[t] - m);
      sum += sh[t];
    }
    inv_sum[h] = 1.f / sum;
  }
  std::fill(out, out + hq * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_row(v_buf + slots[t + kPrefetchAhead] * row, row);
    const float* v_row = v_buf + slots[t] * row;
    for (int64_t h = 0; h < hq; ++h) {
      const float p = s[h * len + t];
      const float* v = v_row + (h / group) * D;
      float* oh = out + h * D;
#pragma omp simd
      for (int j = 0; j < D; ++j) oh[j] += p * v[j];
    }
  }
  for (int64_t h = 0; h < hq; ++h) {
    float* oh = out + h * D;
    for (int j = 0; j < D; ++j) oh[j] *= inv_sum[h];
  }
}

template <int D>
void run(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new, const torch::Tensor& out_loc,
         torch::Tensor& k_buf, torch::Tensor& v_buf, const torch::Tensor& table, const torch::Tensor& rows,
         const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  const int64_t bs = q.size(0), hkv = k_buf.size(1), hq = q.size(1) / D, row = hkv * D;
  const float* qp = q.data_ptr<float>();
  float* kp = k_buf.data_ptr<float>();
  float* vp = v_buf.data_ptr<float>();
  const float* knp = k_new.data_ptr<float>();
  const float* vnp = v_new.data_ptr<float>();
  const int64_t* locp = out_loc.data_ptr<int64_t>();
  const int64_t skn = k_new.stride(0), svn = v_new.stride(0);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t table_stride = table.stride(0);
  at::parallel_for(0, bs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      // the new token's K/V first: its slot is this request's own (never a shared prefix slot)
      std::copy(knp + b * skn, knp + b * skn + row, kp + locp[b] * row);
      std::copy(vnp + b * svn, vnp + b * svn + row, vp + locp[b] * row);
      attend_request<D>(qp + b * hq * D, hq, hkv, kp, vp, tp + rp[b] * table_stride, lp[b],
                        static_cast<float>(scale), op + b * hq * D, scores);
    }
  });
}

}  // namespace

// Stores each request's new k, v ([bs, num_kv_heads * head_dim], rows may be strided) at its slot
// out_loc[b], then attends. q: [bs, num_heads * head_dim] fp32; k_buf, v_buf: [slots, num_kv_heads,
// head_dim] fp32 contiguous; table: [rows, max_context] int64 slot table; rows, seq_lens, out_loc: [bs]
// int64. Returns [bs, num_heads * head_dim].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, torch::Tensor out_loc,
                               torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor table, torch::Tensor rows,
                               torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_buf.scalar_type() == torch::kFloat &&
                  v_buf.scalar_type() == torch::kFloat && k_new.scalar_type() == torch::kFloat &&
                  v_new.scalar_type() == torch::kFloat, "decode_attention: fp32 only");
  TORCH_CHECK(table.scalar_type() == torch::kLong && rows.scalar_type() == torch::kLong &&
                  seq_lens.scalar_type() == torch::kLong && out_loc.scalar_type() == torch::kLong,
              "decode_attention: int64 indices");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && table.stride(1) == 1, "decode_attention: layout");
  const int64_t bs = q.size(0), row_floats = k_buf.size(1) * k_buf.size(2);
  TORCH_CHECK(rows.numel() == bs && seq_lens.numel() == bs && out_loc.numel() == bs && rows.is_contiguous() &&
                  seq_lens.is_contiguous() && out_loc.is_contiguous(), "decode_attention: one row, length, slot per request");
  TORCH_CHECK(k_new.dim() == 2 && v_new.dim() == 2 && k_new.size(0) == bs && v_new.size(0) == bs &&
                  k_new.size(1) == row_floats && v_new.size(1) == row_floats && k_new.stride(1) == 1 &&
                  v_new.stride(1) == 1, "decode_attention: new k/v shape");
  q = q.contiguous();
  const int64_t d = k_buf.size(2);
  TORCH_CHECK(q.size(1) % d == 0 && (q.size(1) / d) % k_buf.size(1) == 0 && q.size(1) / d <= 64,
              "decode_attention: head counts");
  auto out = torch::empty_like(q);
  switch (d) {
    case 64: run<64>(q, k_new, v_new, out_loc, k_buf, v_buf, table, rows, seq_lens, scale, out); break;
    case 128: run<128>(q, k_new, v_new, out_loc, k_buf, v_buf, table, rows, seq_lens, scale, out); break;
    case 256: run<256>(q, k_new, v_new, out_loc, k_buf, v_buf, table, rows, seq_lens, scale, out); break;
    default: TORCH_CHECK(false, "decode_attention: head_dim ", d, " not compiled (64, 128, 256)");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "store the new K/V, then fp32 decode attention over the KV pool");
}
