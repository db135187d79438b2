// The amx tier's bf16 tile products (see amx_gemm.h). Built with the AMX flags; nothing here
// runs unless the tier is supported and the OS granted the tile data state
// (IsaSupported(Isa::kAmx)). The operand packers are the avx512bf16 tier's (bf16_gemm.h).
#include <immintrin.h>

#include <cstring>

#include "csrc/core/gemm/amx_gemm.h"

namespace tokamax {
namespace {

// The 64-byte operand of ldtilecfg (palette 1): every one of the 8 tiles is 16 rows of 64
// bytes. Tiles 0-3 hold C (16 x 16 fp32), 4-5 A (16 x 32 bf16), 6-7 B (16 pairs x 16 columns).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// C tiles [i0, i0 + 16 * MT) x [j0, j0 + 16 * NT) over the whole depth.
template <int MT, int NT>
void Block(int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t panel, float* c, int64_t ldc,
           bool accumulate) {
  const int64_t lda_bytes = lda * 2, ldc_bytes = ldc * 4;
  float* c1 = c + 16;
  float* c2 = c + 16 * ldc;
  float* c3 = c2 + 16;
  if (accumulate) {
    _tile_loadd(0, c, ldc_bytes);
    if constexpr (NT == 2) _tile_loadd(1, c1, ldc_bytes);
    if constexpr (MT == 2) _tile_loadd(2, c2, ldc_bytes);
    if constexpr (MT == 2 && NT == 2) _tile_loadd(3, c3, ldc_bytes);
  } else {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  }
  const uint16_t* a1 = a + 16 * lda;
  const uint16_t* b1 = b + panel;
  for (int64_t p = 0; p < depth; p += kBf16TileDepth) {
    _tile_loadd(4, a + p, lda_bytes);
    _tile_loadd(6, b + p * 16, 64);
    if constexpr (MT == 2) _tile_loadd(5, a1 + p, lda_bytes);
    if constexpr (NT == 2) _tile_loadd(7, b1 + p * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, ldc_bytes);
  if constexpr (NT == 2) _tile_stored(1, c1, ldc_bytes);
  if constexpr (MT == 2) _tile_stored(2, c2, ldc_bytes);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, c3, ldc_bytes);
}

// A 64 x 16 (kRowTiles = 4) or 16 x 64 (kRowTiles = 1) strip of C: four accumulators along
// the long side, each with its own dependency chain, one tile register reloaded for the long
// operand. For the skinny products of few-row (decode) tiles, where a 2 x 2 block would
// leave two chains of the strip's depth and wait on the tile unit's latency.
template <int kRowTiles>
void Strip(int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t panel, float* c, int64_t ldc,
           bool accumulate) {
  constexpr bool kTall = kRowTiles == 4;
  const int64_t lda_bytes = lda * 2, ldc_bytes = ldc * 4;
  auto c_at = [&](int t) { return kTall ? c + t * 16 * ldc : c + t * 16; };
  if (accumulate) {
    _tile_loadd(0, c_at(0), ldc_bytes);
    _tile_loadd(1, c_at(1), ldc_bytes);
    _tile_loadd(2, c_at(2), ldc_bytes);
    _tile_loadd(3, c_at(3), ldc_bytes);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t p = 0; p < depth; p += kBf16TileDepth) {
    if constexpr (kTall) {
      _tile_loadd(6, b + p * 16, 64);
      _tile_loadd(4, a + p, lda_bytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, a + 16 * lda + p, lda_bytes);
      _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(4, a + 32 * lda + p, lda_bytes);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(5, a + 48 * lda + p, lda_bytes);
      _tile_dpbf16ps(3, 5, 6);
    } else {
      _tile_loadd(4, a + p, lda_bytes);
      _tile_loadd(6, b + p * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + panel + p * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, b + 2 * panel + p * 16, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, b + 3 * panel + p * 16, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  _tile_stored(0, c_at(0), ldc_bytes);
  _tile_stored(1, c_at(1), ldc_bytes);
  _tile_stored(2, c_at(2), ldc_bytes);
  _tile_stored(3, c_at(3), ldc_bytes);
}

void ScaleBlock(float* c, int64_t ldc, int64_t rows, int64_t cols, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; j += 16) {
      _mm512_storeu_ps(c + i * ldc + j, _mm512_mul_ps(s, _mm512_loadu_ps(c + i * ldc + j)));
    }
  }
}

}  // namespace

AmxTileScope::AmxTileScope() {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  // Not _tile_loadconfig: GCC 12's intrinsic declares an 8-byte memory operand, so the stores
  // of the other 56 bytes were dropped as dead (measured: every tile left unconfigured).
  __asm__ volatile("ldtilecfg %0" : : "m"(config));
}

AmxTileScope::~AmxTileScope() { _tile_release(); }

void AmxGemmBf16(int64_t m, int64_t n, int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b,
                 float* c, int64_t ldc, bool accumulate, float scale) {
  const int64_t panel = depth * 16;  // elements of one 16-column VNNI panel
  // One tile row or column: 4-long strips first.
  int64_t strip_rows = 0, strip_cols = 0;
  if (n == 16) {
    for (; strip_rows + 64 <= m; strip_rows += 64) {
      Strip<4>(depth, a + strip_rows * lda, lda, b, panel, c + strip_rows * ldc, ldc, accumulate);
      if (!accumulate && scale != 1.0f) ScaleBlock(c + strip_rows * ldc, ldc, 64, 16, scale);
    }
  } else if (m == 16) {
    for (; strip_cols + 64 <= n; strip_cols += 64) {
      Strip<1>(depth, a, lda, b + (strip_cols / 16) * panel, panel, c + strip_cols, ldc, accumulate);
      if (!accumulate && scale != 1.0f) ScaleBlock(c + strip_cols, ldc, 16, 64, scale);
    }
  }
  for (int64_t i0 = strip_rows; i0 < m; i0 += 32) {
    const bool two_rows = i0 + 32 <= m;
    for (int64_t j0 = strip_cols; j0 < n; j0 += 32) {
      const bool two_cols = j0 + 32 <= n;
      const uint16_t* ai = a + i0 * lda;
      const uint16_t* bj = b + (j0 / 16) * panel;
      float* cij = c + i0 * ldc + j0;
      if (two_rows && two_cols) {
        Block<2, 2>(depth, ai, lda, bj, panel, cij, ldc, accumulate);
      } else if (two_rows) {
        Block<2, 1>(depth, ai, lda, bj, panel, cij, ldc, accumulate);
      } else if (two_cols) {
        Block<1, 2>(depth, ai, lda, bj, panel, cij, ldc, accumulate);
      } else {
        Block<1, 1>(depth, ai, lda, bj, panel, cij, ldc, accumulate);
      }
      if (!accumulate && scale != 1.0f) ScaleBlock(cij, ldc, two_rows ? 32 : 16, two_cols ? 32 : 16, scale);
    }
  }
}

}  // namespace tokamax
