// bf16 products with fp32 accumulation on the unit a tier has for them, and the packers of
// their operands. Two engines share one operand format and one contract:
//  - the amx tier: the AMX tile unit (amx_gemm.h), 16 x 16 fp32 tiles, 32 bf16 deep;
//  - the avx512bf16 tier: the AVX512-BF16 dot instruction (vdpbf16ps), 16 fp32 lanes, each the
//    sum of two bf16 products, at twice the fp32 FMA rate per multiply-add on Zen 4.
// Tiers without either keep the fp32 micro-kernels (gemm.h) for bf16, widening it.
//
// A product C[m x n] (+)= A[m x depth] · B[depth x n]: A is row-major bf16 read in place (any row
// stride); B is packed in VNNI panels: 16 columns wide, and for each pair of depth steps the two
// values of a column adjacent, so B(p, j) is at
//   b[(j / 16) * depth * 16 + (p / 2) * 32 + (j % 16) * 2 + p % 2].
// Accumulation is fp32 in a fixed order that depends on depth and the engine only, so results
// are bitwise reproducible for a tier.
#pragma once

#include <cstdint>
#include <memory>

#include "csrc/core/runtime/isa.h"

namespace tokamax {

class AmxTileScope;

constexpr int64_t kBf16TileRows = 16;   // m and n are multiples of this
constexpr int64_t kBf16TileDepth = 32;  // depth is a multiple of this

// c[i * ldc + j] = scale * sum_p A(i, p) B(p, j), or += the unscaled sum when accumulating,
// for i < m, j < n, p < depth, with A(i, p) = a[i * lda + p]. lda and ldc are in elements.
using Bf16GemmFn = void (*)(int64_t m, int64_t n, int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b,
                            float* c, int64_t ldc, bool accumulate, float scale);

// The column-dot form (gemm.h, kGemmDotMaxRows) of bf16 A and B on the dot instruction:
// c[i * ldc + j] = sum_p A(i, p) B(p, j) for i < rows (1 <= rows <= 8), j < cols, p < depth, with
// A(i, p) = a[i * lda + p] (zero from depth up to lda, a multiple of 32) and B(p, j) = b[j * ldb +
// p], B's columns contiguous along p. Lane l sums the pairs p = 32s + 2l, 32s + 2l + 1 in order
// of s (vdpbf16ps), then one fixed reduction: the bits depend on the depth only.
using Bf16ColumnDotsFn = void (*)(int64_t rows, int64_t cols, int64_t depth, const uint16_t* a, int64_t lda,
                                  const uint16_t* b, int64_t ldb, float* c, int64_t ldc);

// A tier's bf16 product engine: `gemm` is null on tiers without one. `tile_unit` engines run
// only inside a Bf16ProductScope; `column_dots` (the AVX512-BF16 instruction, on both tiers)
// needs none.
struct Bf16Products {
  Bf16GemmFn gemm = nullptr;
  Bf16ColumnDotsFn column_dots = nullptr;
  bool tile_unit = false;
  explicit operator bool() const { return gemm != nullptr; }
};

// amx: the tile unit; avx512bf16: the dot instruction; other tiers: none.
Bf16Products GetBf16Products(Isa isa);

// What `products` needs on the calling thread for its lifetime (the AMX tile configuration);
// nothing for the dot engine.
class Bf16ProductScope {
 public:
  explicit Bf16ProductScope(const Bf16Products& products);
  ~Bf16ProductScope();
  Bf16ProductScope(const Bf16ProductScope&) = delete;
  Bf16ProductScope& operator=(const Bf16ProductScope&) = delete;

 private:
  std::unique_ptr<AmxTileScope> tiles_;
};

// The avx512bf16 engine (Bf16GemmFn's contract); needs AVX512-BF16 (IsaSupported(kAvx512Bf16)).
void DotGemmBf16(int64_t m, int64_t n, int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b, float* c,
                 int64_t ldc, bool accumulate, float scale);

// Bf16ColumnDotsFn's contract on vdpbf16ps; needs AVX512-BF16.
void ColumnDotsBf16(int64_t rows, int64_t cols, int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b,
                    int64_t ldb, float* c, int64_t ldc);

// ---- operand packers: AVX-512 BW/BF16 code, callable on the avx512bf16 and amx tiers --------

// Packs B(p, j) = x[p * ld + j] (fp32 rounded to bf16) for p < rows, and 0 for rows <= p <
// depth, into VNNI panels of `depth` (a multiple of 32) for j < n (a multiple of 16).
void PackVnniFromRows(const float* x, int64_t ld, int64_t rows, int64_t depth, int64_t n, uint16_t* dst);

// PackVnniFromRows of exp(x[p * ld + j] - sub[j]) (the avx512 softmax tier's exp, bit for
// bit), adding the column sums of the fp32 values, row by row, to sums[j]: the online
// softmax's exponentiation and the probabilities' packing in one pass. x is not written.
void ExpPackVnni(const float* x, int64_t ld, int64_t rows, int64_t depth, int64_t n, const float* sub, float* sums,
                 uint16_t* dst);

// PackVnniFromRows for bf16 rows: B(p, j) = x[p * ld + j] for p < rows, 0 for rows <= p <
// depth (even), j < n (a multiple of 16); exact.
void PackVnniFromBf16Rows(const uint16_t* x, int64_t ld, int64_t rows, int64_t depth, int64_t n, uint16_t* dst);

// Depth steps p and p + 1 (p even) of VNNI panels of `depth` for j < n: B(p, j) = a[j] and
// B(p + 1, j) = b[j], bf16; a null row is zeros. Lets a caller fill panels in its own order.
void PackVnniPair(const uint16_t* a, const uint16_t* b, int64_t p, int64_t depth, int64_t n, uint16_t* dst);

// One panel as above from 16 bf16 vectors: B(p, j) = vectors[j][p * step] for p <
// valid_depth, zero past it and for a null vector. Xᵀ over 16 rows (or columns) of a strided X.
// `block` is the caller's scratch of 16 * depth elements (its lease's, scratch_arena.h: callers
// fill many panels, and one lease serves them all).
void PackVnniFromBf16Vectors(const uint16_t* const vectors[16], int64_t step, int64_t valid_depth, int64_t depth,
                             uint16_t* dst, uint16_t* block);

// A bf16 matrix X (X(i, j) at src[i * row_stride + j * col_stride], rows x cols) copied
// row-major, dst[i * ld + j], or with `transpose` as Xᵀ, dst[j * ld + i]: by rows along a
// contiguous dimension, by the register transpose across one, elementwise otherwise.
void CopyBf16(const uint16_t* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols, bool transpose,
              uint16_t* dst, int64_t ld);

// dst[r * ld_dst + c] = x[r * ld + c] rounded to bf16 for r < rows, c < cols (a multiple of
// 16), and zero rows for rows <= r < pad_rows: an fp32 tile as a row-major A operand.
void ConvertRowsBf16(const float* x, int64_t ld, int64_t rows, int64_t pad_rows, int64_t cols, uint16_t* dst,
                     int64_t ld_dst);

// One 16-column VNNI panel of `depth` (even) from 16 contiguous bf16 rows x[j * depth + p]:
// B(p, j) = x[j * depth + p], exact. The B operand Xᵀ of a product over X's columns.
void PackVnniFromBf16Block(const uint16_t* x, int64_t depth, uint16_t* dst);

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols: a bf16 (any 16-bit)
// transpose, as the A operand Xᵀ of a product over X's rows. Takes a ScratchLease per call
// (scratch_arena.h) for 16 rows at a time.
void TransposeBf16(const uint16_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint16_t* dst, int64_t ld_dst);

}  // namespace tokamax
