// bf16 GEMMs on AMX tiles (Intel Sapphire Rapids and later) for runtime.cpu_matmul_precision=medium.
//
// y = x @ W^T with x rounded to bf16 (round to nearest even, as vdpbf16ps takes it) and the products
// summed in fp32 by TDPBF16PS; y is fp32, never rounded. Every row is computed alone in the same K
// order whatever the number of rows, its place in the batch or the other rows, so results do not
// depend on batching (oneDNN's bf16 GEMM picks its blocking by the row count: its rows differ).
//
// W is packed once (layers/cpu_gemm.py `to_amx`) as int16 bf16 bits [N/16, K/32, 16, 16, 2]: per
// block of 16 output columns and 32 inputs, one 1 KiB B tile (16 rows of 16 column pairs: element
// [p][n][j] is W[n][32 k + 2 p + j]). A gated [gate; up] weight is packed with its blocks interleaved
// (gate block j, then up block j), so the two C tiles of a column pair are gate and up of the same
// 16 columns and silu(gate) * up is written straight from them.
//
// Tiles: C 0-3 (2 x 2 blocks of 16 x 16 fp32), A 4-5 (16 rows x 32 bf16), B 6-7. Built everywhere;
// without AMX in the build (`__AMX_BF16__`) `available()` is false and nothing else is called.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RS_AMX 1
#else
#define RS_AMX 0
#endif

namespace {

constexpr int64_t TILE_ROWS = 16;  // rows of x per A tile, of y per C tile
constexpr int64_t TILE_K = 32;     // bf16 inputs per A-tile row (64 bytes)
constexpr int64_t TILE_N = 16;     // output columns per B / C tile
constexpr int64_t B_TILE = TILE_K * TILE_N;  // bf16 elements of one packed B tile

#if RS_AMX
bool request_tile_permission() {
  // Linux hands out the AMX state only on request (once per process)
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
    constexpr long XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles() {  // every tile 16 rows of 64 bytes; per thread (the tile state is)
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = TILE_ROWS;
  }
  _tile_loadconfig(&cfg);
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// One block of up to 32 rows x 32 columns: rows m0.. (two A tiles when R2), the column blocks b0
// (and b1 when C2) of K / 32 packed B tiles each. Plain: C tiles stored into y (ldy floats a row).
// Gated (C2 always): tile 0/2 hold gate, 1/3 up of the same 16 columns, written as silu(gate) * up.
template <bool R2, bool C2, bool GATED>
inline void block(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t kb, float* y,
                  int64_t ldy) {
  _tile_zero(0);
  if constexpr (C2) _tile_zero(1);
  if constexpr (R2) {
    _tile_zero(2);
    if constexpr (C2) _tile_zero(3);
  }
  const int64_t a_stride = lda * 2;  // bytes
  for (int64_t k = 0; k < kb; ++k) {
    _tile_loadd(4, a + k * TILE_K, a_stride);
    _tile_loadd(6, b0 + k * B_TILE, 64);
    if constexpr (C2) _tile_loadd(7, b1 + k * B_TILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (C2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (R2) {
      _tile_loadd(5, a + TILE_ROWS * lda + k * TILE_K, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (C2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  if constexpr (GATED) {
    alignas(64) float g[TILE_ROWS * TILE_N];
    alignas(64) float u[TILE_ROWS * TILE_N];
    for (int half = 0; half < (R2 ? 2 : 1); ++half) {
      if (half == 0) {
        _tile_stored(0, g, TILE_N * 4);
        _tile_stored(1, u, TILE_N * 4);
      } else {
        if constexpr (R2) {
          _tile_stored(2, g, TILE_N * 4);
          _tile_stored(3, u, TILE_N * 4);
        }
      }
      float* out = y + half * TILE_ROWS * ldy;
      for (int64_t r = 0; r < TILE_ROWS; ++r)
        for (int64_t c = 0; c < TILE_N; ++c) out[r * ldy + c] = silu(g[r * TILE_N + c]) * u[r * TILE_N + c];
    }
  } else {
    const int64_t y_stride = ldy * 4;
    _tile_stored(0, y, y_stride);
    if constexpr (C2) _tile_stored(1, y + TILE_N, y_stride);
    if constexpr (R2) {
      _tile_stored(2, y + TILE_ROWS * ldy, y_stride);
      if constexpr (C2) _tile_stored(3, y + TILE_ROWS * ldy + TILE_N, y_stride);
    }
  }
}

template <bool GATED>
void run_rows(const uint16_t* a, int64_t lda, int64_t rows, const uint16_t* w, int64_t kb, int64_t nb, float* y,
              int64_t ldy) {
  // column-block pairs split over the threads; each thread walks all rows of its columns
  const int64_t pairs = (nb + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* b0 = w + (2 * p) * kb * B_TILE;
      const bool two = 2 * p + 1 < nb;
      const uint16_t* b1 = two ? b0 + kb * B_TILE : b0;
      // a gated pair is one output block of 16 columns; a plain pair two
      float* yp = y + (GATED ? p * TILE_N : 2 * p * TILE_N);
      int64_t m = 0;
      for (; m + 2 * TILE_ROWS <= rows; m += 2 * TILE_ROWS) {
        if (GATED || two)
          block<true, true, GATED>(a + m * lda, lda, b0, b1, kb, yp + m * ldy, ldy);
        else
          block<true, false, false>(a + m * lda, lda, b0, b1, kb, yp + m * ldy, ldy);
      }
      if (m < rows) {  // rows is a multiple of 16: one A tile left
        if (GATED || two)
          block<false, true, GATED>(a + m * lda, lda, b0, b1, kb, yp + m * ldy, ldy);
        else
          block<false, false, false>(a + m * lda, lda, b0, b1, kb, yp + m * ldy, ldy);
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace

bool available() {
#if RS_AMX
  return request_tile_permission();
#else
  return false;
#endif
}

// x: fp32 [M, K], rows contiguous; packed: int16 [N/16, K/32, 16, 16, 2]; out_features: N, or the
// activation's width I of a gated packing (N = 2 I). Returns fp32 [M, out_features].
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, bool gated) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x: fp32 [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == torch::kInt16 && packed.is_contiguous(), "packed: AMX tiles");
  const int64_t m = x.size(0), k = x.size(1), nb = packed.size(0), kb = packed.size(1);
  TORCH_CHECK(kb * TILE_K == k, "x has ", k, " inputs, the packed weight ", kb * TILE_K);
  TORCH_CHECK(nb * TILE_N == (gated ? 2 * out_features : out_features), "the packed weight has ", nb * TILE_N,
              " rows for ", out_features, gated ? " gated outputs" : " outputs");
#if RS_AMX
  TORCH_CHECK(available(), "AMX tiles are not available to this process");
  const int64_t rows = (m + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;  // padded with zero rows
  auto a = torch::zeros({rows, k}, x.options().dtype(torch::kBFloat16));
  a.narrow(0, 0, m).copy_(x);  // round to nearest even
  auto y = torch::empty({rows, out_features}, x.options());
  const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  if (gated)
    run_rows<true>(ap, k, rows, wp, kb, nb, y.data_ptr<float>(), out_features);
  else
    run_rows<false>(ap, k, rows, wp, kb, nb, y.data_ptr<float>(), out_features);
  return rows == m ? y : y.narrow(0, 0, m);
#else
  TORCH_CHECK(false, "this build has no AMX kernels");
  return x;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether AMX bf16 tiles run in this process");
  m.def("linear", &linear, "x @ W^T (or silu(gate) * up) on AMX tiles, fp32 sums");
}
