// The avx512bf16 tier's bf16 product engine (DotGemmBf16, vdpbf16ps) and the operand packers
// shared with the amx tier (bf16_gemm.h). Built with AVX-512 BW/VL/BF16 flags: nothing here
// runs unless IsaSupported(Isa::kAvx512Bf16), which the amx tier implies.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "csrc/core/gemm/bf16_gemm.h"
#include "csrc/core/base/dtype.h"
#include "csrc/core/base/int_math.h"
#include "csrc/core/runtime/scratch_arena.h"
#include "csrc/core/vec/vec.h"  // Exp: the softmax tiers' polynomial, bit for bit

namespace tokamax {
namespace {

// A kRows x (16 * kPanels) block of C over the whole depth, one fp32 accumulator per (row,
// panel). Each depth pair broadcasts A(i, p), A(i, p + 1) as one 32-bit lane pair and
// multiplies it into a panel's 16 column pairs with one vdpbf16ps; every element of C sums its
// pairs in depth order, whatever block it falls in. When accumulating, the block that runs next
// (next_c, kRows rows of 48 columns, or null) is asked for into L2: the accumulators start from
// C so that the bits do not depend on the depth slicing, and a slice's C (the caller's tile
// buffer, larger than L2 for a whole task) was otherwise waited for at every block's start.
template <int kRows, int kPanels>
void DotBlock(int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t panel, float* c, int64_t ldc,
              bool accumulate, float scale, const float* next_c) {
  if (accumulate && next_c != nullptr) {
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      const char* row = reinterpret_cast<const char*>(next_c + i * ldc);
      _mm_prefetch(row, _MM_HINT_T1);
      _mm_prefetch(row + 64, _MM_HINT_T1);
      _mm_prefetch(row + 128, _MM_HINT_T1);
    }
  }
  __m512 acc[kRows][kPanels];
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int q = 0; q < kPanels; ++q) {
      acc[i][q] = accumulate ? _mm512_loadu_ps(c + i * ldc + q * 16) : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < depth; p += 2) {
    __m512bh bq[kPanels];
#pragma GCC unroll 4
    for (int q = 0; q < kPanels; ++q) {
      bq[q] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + q * panel + p * 16));
    }
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + p, sizeof(pair));
      const __m512bh ai = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
      for (int q = 0; q < kPanels; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], ai, bq[q]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  const bool scaled = !accumulate && scale != 1.0f;
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int q = 0; q < kPanels; ++q) {
      _mm512_storeu_ps(c + i * ldc + q * 16, scaled ? _mm512_mul_ps(s, acc[i][q]) : acc[i][q]);
    }
  }
}

// kRows-row strips of C, three panels (48 columns) at a time, then the last one or two. Each
// block asks for the next one's C: the strip's next block, else `next_strip` (null: none).
template <int kRows>
void DotRows(int64_t n, int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t panel, float* c,
             int64_t ldc, bool accumulate, float scale, const float* next_strip) {
  int64_t j0 = 0;
  auto next = [&](int64_t j) { return j < n ? c + j : next_strip; };
  for (; j0 + 48 <= n; j0 += 48) {
    DotBlock<kRows, 3>(depth, a, lda, b + (j0 / 16) * panel, panel, c + j0, ldc, accumulate, scale, next(j0 + 48));
  }
  if (n - j0 == 32) {
    DotBlock<kRows, 2>(depth, a, lda, b + (j0 / 16) * panel, panel, c + j0, ldc, accumulate, scale, next_strip);
  }
  if (n - j0 == 16) {
    DotBlock<kRows, 1>(depth, a, lda, b + (j0 / 16) * panel, panel, c + j0, ldc, accumulate, scale, next_strip);
  }
}

using TOKAMAX_TIER_NAMESPACE::Exp;
using TOKAMAX_TIER_NAMESPACE::Transpose8x8;

// vpermw index that interleaves two converted rows: out[2i] = lo[i], out[2i + 1] = hi[i].
__m512i InterleaveOrder() {
  alignas(64) int16_t order[32];
  for (int i = 0; i < 16; ++i) {
    order[2 * i] = static_cast<int16_t>(i);
    order[2 * i + 1] = static_cast<int16_t>(16 + i);
  }
  return _mm512_load_si512(order);
}

// One VNNI row of a panel: lo and hi (depth steps p and p + 1 of 16 columns) rounded to bf16
// (cvtne2ps: nearest even, upper half from the first operand) and interleaved.
inline void StoreVnniPair(__m512 lo, __m512 hi, __m512i interleave, uint16_t* dst) {
  const __m512i pair = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave, pair));
}

}  // namespace

void DotGemmBf16(int64_t m, int64_t n, int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b, float* c,
                 int64_t ldc, bool accumulate, float scale) {
  const int64_t panel = depth * 16;  // elements of one 16-column VNNI panel
  for (int64_t i0 = 0; i0 < m; i0 += 8) {
    DotRows<8>(n, depth, a + i0 * lda, lda, b, panel, c + i0 * ldc, ldc, accumulate, scale,
               i0 + 8 < m ? c + (i0 + 8) * ldc : nullptr);
  }
}

namespace {

// kRows x kCols column dots: each step loads 32 depth values of every column once and of every
// row once, one vdpbf16ps per (row, column).
template <int kRows, int kCols>
void ColumnDotTile(int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c,
                   int64_t ldc) {
  __m512 acc[kRows * kCols];
#pragma GCC unroll 24
  for (int i = 0; i < kRows * kCols; ++i) acc[i] = _mm512_setzero_ps();
  // One step of 32 depth values; B's tail read under `mask` (zeros past the depth), A is
  // zero-padded to lda.
  auto step = [&](int64_t p, __mmask32 mask) {
    __m512bh column[kCols];
#pragma GCC unroll 8
    for (int j = 0; j < kCols; ++j) {
      column[j] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, b + j * ldb + p));
    }
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      const __m512bh row = reinterpret_cast<__m512bh>(_mm512_loadu_si512(a + i * lda + p));
#pragma GCC unroll 8
      for (int j = 0; j < kCols; ++j) acc[i * kCols + j] = _mm512_dpbf16_ps(acc[i * kCols + j], row, column[j]);
    }
  };
  int64_t p = 0;
  for (; p + 32 <= depth; p += 32) step(p, ~__mmask32{0});
  if (p < depth) step(p, (__mmask32{1} << (depth - p)) - 1);
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < kCols; ++j) c[i * ldc + j] = _mm512_reduce_add_ps(acc[i * kCols + j]);
  }
}

// Columns in groups that keep at most 24 accumulators (of 32 registers), the rest one by one.
template <int kRows>
void ColumnDotRows(int64_t cols, int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                   float* c, int64_t ldc) {
  constexpr int kCols = std::clamp(24 / kRows, 1, 8);
  int64_t j = 0;
  for (; j + kCols <= cols; j += kCols) ColumnDotTile<kRows, kCols>(depth, a, lda, b + j * ldb, ldb, c + j, ldc);
  for (; j < cols; ++j) ColumnDotTile<kRows, 1>(depth, a, lda, b + j * ldb, ldb, c + j, ldc);
}

}  // namespace

void ColumnDotsBf16(int64_t rows, int64_t cols, int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b,
                    int64_t ldb, float* c, int64_t ldc) {
  DispatchRows<8>(rows, [&](auto n) { ColumnDotRows<decltype(n)::value>(cols, depth, a, lda, b, ldb, c, ldc); });
}

void PackVnniFromRows(const float* x, int64_t ld, int64_t rows, int64_t depth, int64_t n, uint16_t* dst) {
  const __m512i interleave = InterleaveOrder();
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t q = 0; q * 16 < n; ++q) {
    uint16_t* panel = dst + q * depth * 16;
    for (int64_t p = 0; p < depth; p += 2) {
      const __m512 lo = p < rows ? _mm512_loadu_ps(x + p * ld + q * 16) : zero;
      const __m512 hi = p + 1 < rows ? _mm512_loadu_ps(x + (p + 1) * ld + q * 16) : zero;
      StoreVnniPair(lo, hi, interleave, panel + p * 16);
    }
  }
}

void ExpPackVnni(const float* x, int64_t ld, int64_t rows, int64_t depth, int64_t n, const float* sub, float* sums,
                    uint16_t* dst) {
  const __m512i interleave = InterleaveOrder();
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t q = 0; q * 16 < n; ++q) {
    const __m512 s = _mm512_loadu_ps(sub + q * 16);
    __m512 total = zero;
    uint16_t* panel = dst + q * depth * 16;
    for (int64_t p = 0; p < depth; p += 2) {
      __m512 lo = zero, hi = zero;
      if (p < rows) {
        lo = Exp(_mm512_sub_ps(_mm512_loadu_ps(x + p * ld + q * 16), s));
        total = _mm512_add_ps(total, lo);
      }
      if (p + 1 < rows) {
        hi = Exp(_mm512_sub_ps(_mm512_loadu_ps(x + (p + 1) * ld + q * 16), s));
        total = _mm512_add_ps(total, hi);
      }
      StoreVnniPair(lo, hi, interleave, panel + p * 16);
    }
    _mm512_storeu_ps(sums + q * 16, _mm512_add_ps(_mm512_loadu_ps(sums + q * 16), total));
  }
}

void PackVnniFromBf16Rows(const uint16_t* x, int64_t ld, int64_t rows, int64_t depth, int64_t n, uint16_t* dst) {
  // Panel by panel, two at a time from one 64-byte run of each row: every panel is written as
  // one sequential stream. Pair by pair across all panels stored 64 bytes a panel apart, and
  // a panel is often a multiple of 4 KiB: every store of a pair fell on one L1 set (ragged_dot
  // bf16 with groups of 64 rows spent a quarter of its time here, amd_zen4_avx512bf16).
  alignas(64) int16_t order[2][32];
  for (int i = 0; i < 16; ++i) {
    order[0][2 * i] = static_cast<int16_t>(i);  // first panel: columns 0-15 of both rows
    order[0][2 * i + 1] = static_cast<int16_t>(32 + i);
    order[1][2 * i] = static_cast<int16_t>(16 + i);  // second panel: columns 16-31
    order[1][2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i first = _mm512_load_si512(order[0]), second = _mm512_load_si512(order[1]);
  const int64_t panel = depth * 16;
  for (int64_t q = 0; q * 16 < n; q += 2) {
    const bool two = (q + 2) * 16 <= n;
    // The last single panel reads 16 columns only (a 32-byte masked load).
    const __mmask32 cols = two ? ~__mmask32{0} : __mmask32{0xFFFF};
    uint16_t* out = dst + q * panel;
    for (int64_t p = 0; p < depth; p += 2) {
      const __m512i lo = p < rows ? _mm512_maskz_loadu_epi16(cols, x + p * ld + q * 16) : _mm512_setzero_si512();
      const __m512i hi =
          p + 1 < rows ? _mm512_maskz_loadu_epi16(cols, x + (p + 1) * ld + q * 16) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + p * 16, _mm512_permutex2var_epi16(lo, first, hi));
      if (two) _mm512_storeu_si512(out + panel + p * 16, _mm512_permutex2var_epi16(lo, second, hi));
    }
  }
}

void PackVnniPair(const uint16_t* a, const uint16_t* b, int64_t p, int64_t depth, int64_t n, uint16_t* dst) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t q = 0; q * 16 < n; ++q) {
    const __m256i x = a != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + q * 16)) : zero;
    const __m256i y = b != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + q * 16)) : zero;
    // unpack works within 128-bit lanes: columns 0-3 and 8-11 low, 4-7 and 12-15 high.
    const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
    uint16_t* out = dst + q * depth * 16 + p * 16;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
}

void ConvertRowsBf16(const float* x, int64_t ld, int64_t rows, int64_t pad_rows, int64_t cols, uint16_t* dst,
                        int64_t ld_dst) {
  for (int64_t r = 0; r < pad_rows; ++r) {
    uint16_t* out = dst + r * ld_dst;
    if (r >= rows) {
      std::memset(out, 0, cols * sizeof(uint16_t));
      continue;
    }
    for (int64_t c = 0; c < cols; c += 16) {
      const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * ld + c)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), bits);
    }
  }
}

void TransposeBf16(const uint16_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint16_t* dst,
                      int64_t ld_dst) {
  // Blocks of 16 rows: the rows are copied contiguous first (read whole, once: rows of one kv
  // head sit a cache-set stride apart, and revisiting them per column block missed L1), then
  // each two rows interleave into 32-bit pairs (dst's layout of two adjacent rows) and every
  // 8 x 8 matrix of pairs is transposed as 32-bit lanes.
  ScratchLease scratch;  // nested in the caller's, if any: distinct memory
  uint16_t* block = scratch.Get<uint16_t>(0, 16 * cols);
  alignas(32) uint32_t pairs[8][8];
  const bool pairs_fit = ld_dst % 2 == 0 && reinterpret_cast<uintptr_t>(dst) % 4 == 0;
  int64_t r0 = 0;
  for (; pairs_fit && r0 + 16 <= rows; r0 += 16) {
    for (int64_t r = 0; r < 16; ++r) std::memcpy(&block[r * cols], src + (r0 + r) * ld_src, cols * sizeof(uint16_t));
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) {
      for (int i = 0; i < 8; ++i) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&block[(2 * i) * cols + c0]));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&block[(2 * i + 1) * cols + c0]));
        _mm_store_si128(reinterpret_cast<__m128i*>(&pairs[i][0]), _mm_unpacklo_epi16(a, b));
        _mm_store_si128(reinterpret_cast<__m128i*>(&pairs[i][4]), _mm_unpackhi_epi16(a, b));
      }
      // Shuffles only: the bits pass through the float lanes unchanged.
      Transpose8x8(reinterpret_cast<const float*>(&pairs[0][0]), 8, reinterpret_cast<float*>(dst + c0 * ld_dst + r0),
                   ld_dst / 2);
    }
    for (int64_t c = c0; c < cols; ++c) {
      for (int64_t r = 0; r < 16; ++r) dst[c * ld_dst + r0 + r] = block[r * cols + c];
    }
  }
  for (int64_t r = r0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
}

void PackVnniFromBf16Block(const uint16_t* x, int64_t depth, uint16_t* dst) {
  // Row j's pairs (p, p + 1) are one 32-bit unit: the panel is the 32-bit transpose of x.
  const float* src = reinterpret_cast<const float*>(x);
  float* out = reinterpret_cast<float*>(dst);
  const int64_t pairs = depth / 2;
  int64_t p0 = 0;
  for (; p0 + 8 <= pairs; p0 += 8) {
    Transpose8x8(src + p0, pairs, out + p0 * 16, 16);
    Transpose8x8(src + 8 * pairs + p0, pairs, out + p0 * 16 + 8, 16);
  }
  for (int64_t p = p0; p < pairs; ++p) {
    for (int64_t j = 0; j < 16; ++j) std::memcpy(out + p * 16 + j, src + j * pairs + p, sizeof(float));
  }
}

void PackVnniFromBf16Vectors(const uint16_t* const vectors[16], int64_t step, int64_t valid_depth, int64_t depth,
                                uint16_t* dst, uint16_t* block) {
  for (int64_t j = 0; j < 16; ++j) {
    uint16_t* row = block + j * depth;
    const uint16_t* src = vectors[j];
    int64_t p = 0;
    if (src != nullptr && step == 1) {
      std::memcpy(row, src, valid_depth * sizeof(uint16_t));
      p = valid_depth;
    } else if (src != nullptr) {
      for (; p < valid_depth; ++p) row[p] = src[p * step];
    }
    std::fill(row + p, row + depth, uint16_t{0});
  }
  PackVnniFromBf16Block(block, depth, dst);
}

void CopyBf16(const uint16_t* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
                 bool transpose, uint16_t* dst, int64_t ld) {
  // Copying X transposed is copying Xᵀ as it is: swap the view, then dst[i * ld + j] = Y(i, j).
  if (transpose) {
    std::swap(row_stride, col_stride);
    std::swap(rows, cols);
  }
  if (col_stride == 1) {
    for (int64_t i = 0; i < rows; ++i) std::memcpy(dst + i * ld, src + i * row_stride, cols * sizeof(uint16_t));
    return;
  }
  if (row_stride == 1) {  // Y's columns are contiguous: Y is the transpose of a row-major matrix
    TransposeBf16(src, col_stride, cols, rows, dst, ld);
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) dst[i * ld + j] = src[i * row_stride + j * col_stride];
  }
}

}  // namespace tokamax
