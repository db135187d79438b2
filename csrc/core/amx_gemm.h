// bf16 GEMM pieces on the AMX tile unit (TMUL): the fast path for bf16 products on CPUs of the
// amx tier (IsaSupported(Isa::kAmx)); callers keep the fp32 micro-kernels for every other case.
//
// A product C[m x n] (+)= A[m x depth] · B[depth x n] runs in 16 x 16 fp32 tiles of C, 32 bf16
// deep per tile instruction, four C tiles (32 x 32) per block. A is row-major bf16 read in
// place (any row stride); B is packed in VNNI panels: 16 columns wide, and for each pair of
// depth steps the two values of a column adjacent, so B(p, j) is at
//   b[(j / 16) * depth * 16 + (p / 2) * 32 + (j % 16) * 2 + p % 2].
// Accumulation is fp32 in a fixed order that depends on depth only, so results are bitwise
// reproducible.
#pragma once

#include <cstdint>

namespace tokamax {

constexpr int64_t kAmxTileRows = 16;  // m and n are multiples of this
constexpr int64_t kAmxTileDepth = 32; // depth is a multiple of this

// Loads the tile configuration into the calling thread's tile registers for the scope's
// lifetime and releases them at its end. Every AMX call below must run inside one.
class AmxTileScope {
 public:
  AmxTileScope();
  ~AmxTileScope();
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;
};

// c[i * ldc + j] = scale * sum_p A(i, p) B(p, j), or += the unscaled sum when accumulating,
// for i < m, j < n, p < depth, with A(i, p) = a[i * lda + p]. lda and ldc are in elements.
void AmxGemmBf16(int64_t m, int64_t n, int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b,
                 float* c, int64_t ldc, bool accumulate, float scale);

// Packs B(p, j) = x[p * ld + j] (fp32 rounded to bf16) for p < rows, and 0 for rows <= p <
// depth, into VNNI panels of `depth` (a multiple of 32) for j < n (a multiple of 16).
void AmxPackVnniFromRows(const float* x, int64_t ld, int64_t rows, int64_t depth, int64_t n, uint16_t* dst);

// AmxPackVnniFromRows of exp(x[p * ld + j] - sub[j]) (the avx512 softmax tier's exp, bit for
// bit), adding the column sums of the fp32 values, row by row, to sums[j]: the online
// softmax's exponentiation and the probabilities' packing in one pass. x is not written.
void AmxExpPackVnni(const float* x, int64_t ld, int64_t rows, int64_t depth, int64_t n, const float* sub, float* sums,
                    uint16_t* dst);

// Depth steps p and p + 1 (p even) of VNNI panels of `depth` for j < n: B(p, j) = a[j] and
// B(p + 1, j) = b[j], bf16; a null row is zeros. Lets a caller fill panels in its own order.
void AmxPackVnniPair(const uint16_t* a, const uint16_t* b, int64_t p, int64_t depth, int64_t n, uint16_t* dst);

// One panel as above from 16 bf16 vectors: B(p, j) = vectors[j][p * step] for p <
// valid_depth, zero past it and for a null vector. Xᵀ over 16 rows (or columns) of a strided X.
void AmxPackVnniFromBf16Vectors(const uint16_t* const vectors[16], int64_t step, int64_t valid_depth, int64_t depth,
                                uint16_t* dst);

// A bf16 matrix X (X(i, j) at src[i * row_stride + j * col_stride], rows x cols) copied
// row-major, dst[i * ld + j], or with `transpose` as Xᵀ, dst[j * ld + i]: by rows along a
// contiguous dimension, by the register transpose across one, elementwise otherwise.
void AmxCopyBf16(const uint16_t* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
                 bool transpose, uint16_t* dst, int64_t ld);

// dst[r * ld_dst + c] = x[r * ld + c] rounded to bf16 for r < rows, c < cols (a multiple of
// 16), and zero rows for rows <= r < pad_rows: an fp32 tile as a row-major A operand.
void AmxConvertRowsBf16(const float* x, int64_t ld, int64_t rows, int64_t pad_rows, int64_t cols, uint16_t* dst,
                        int64_t ld_dst);

// One 16-column VNNI panel of `depth` (even) from 16 contiguous bf16 rows x[j * depth + p]:
// B(p, j) = x[j * depth + p], exact. The B operand Xᵀ of a product over X's columns.
void AmxPackVnniFromBf16Block(const uint16_t* x, int64_t depth, uint16_t* dst);

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols: a bf16 (any 16-bit)
// transpose, as the A operand Xᵀ of a product over X's rows.
void AmxTransposeBf16(const uint16_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint16_t* dst,
                      int64_t ld_dst);

}  // namespace tokamax
