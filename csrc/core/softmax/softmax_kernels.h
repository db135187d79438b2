// Attention's vector pieces, one set per ISA tier: column-wise softmax on fp32 tiles, and the
// row-wise products of the few-row (decode) path.
//
// Attention keeps its logits transposed, x[key][query row] (keys are the rows of the GEMM that
// makes them), so every per-query reduction runs down a column and vectorizes across queries
// without horizontal sums. `cols` is a multiple of 16 and at most `ld`.
#pragma once

#include <cstdint>

#include "csrc/core/base/dtype.h"
#include "csrc/core/base/int_math.h"
#include "csrc/core/runtime/isa.h"

namespace tokamax {

// Inputs below this give exp() == 0 exactly (masked logits are -inf); every tier flushes here.
constexpr float kExpFlushBelow = -87.0f;

struct SoftmaxKernels {
  // max[c] = max(max[c], x[r][c]) over r < rows.
  void (*column_max)(const float* x, int64_t rows, int64_t ld, int64_t cols, float* max);
  // x[r][c] = exp(x[r][c] - sub[c]); sums[c] += x[r][c] when sums is not null. sub is finite.
  void (*exp_columns)(float* x, int64_t rows, int64_t ld, int64_t cols, const float* sub, float* sums);
  // x[r][c] = -inf unless lo[c] <= r < hi[c]: a range mask (causal, window, lengths) applied
  // to a tile, with lo/hi relative to its first row and exact small integers in float.
  void (*mask_columns)(float* x, int64_t rows, int64_t ld, int64_t cols, const float* lo, const float* hi);
  // x[r][e] *= scale[r] for r < rows, e < width, skipping rows whose scale is exactly 1.
  void (*scale_rows)(float* x, int64_t ld, int64_t rows, int64_t width, const float* scale);
  // dst[q][h][j] = x[(q * nr + j) * ld + h] for h < cols, zero where q * nr + j >= rows: fp32
  // rows transposed into the nr-wide B panels of a GEMM whose depth is `cols` (nr a multiple
  // of 8). Attention packs query and output-gradient rows this way.
  void (*transpose_panels)(const float* x, int64_t ld, int64_t rows, int64_t cols, int64_t nr, float* dst);
  // dp[r][c] = p[r][c] * (dp[r][c] - d[c]): the softmax gradient given dp = dO·Vᵀ.
  void (*softmax_grad_columns)(const float* p, float* dp, int64_t rows, int64_t ld, int64_t cols,
                               const float* d);
  // st[j * ld_st + r] = sum_h key[j][h] * q[r][h] for j < keys, r < rows (at most
  // kMaxRowDotRows): key rows of `dtype` at key + j * ld_key, contiguous along h; q fp32 rows
  // of length depth at q + r * ld_q. Reads each key row once.
  // The row products take `next`, null or rows of the same shape and stride as the ones they
  // read (the caller's next run; which rows come next is the caller's to know), and ask for
  // them into L2 as they go, one prefetch beside each vector they load, so the requests go out
  // spread across the multiply-adds rather than in a burst before them. They never read `next`.
  void (*key_dots)(DType dtype, const void* key, int64_t ld_key, int64_t keys, int64_t depth, const float* q,
                   int64_t ld_q, int64_t rows, float* st, int64_t ld_st, const void* next);
  // acc[r][e] += sum_j p[j * ld_p + r] * value[j][e] for r < rows, e < width: value rows of
  // `dtype` at value + j * ld_value, contiguous along e; acc fp32 rows at acc + r * ld_acc.
  void (*accumulate_values)(DType dtype, const float* p, int64_t ld_p, int64_t keys, int64_t rows,
                            const void* value, int64_t ld_value, int64_t width, float* acc, int64_t ld_acc,
                            const void* next);
  // x[r][c] *= scale[c] for r < rows, c < cols: scale_rows for a transposed accumulator.
  void (*scale_columns)(float* x, int64_t ld, int64_t rows, int64_t cols, const float* scale);
  // dst[h] = scale * x[h] for h < count: one contiguous row of `dtype` widened to fp32, the same
  // bits as the scalar product (attention gathers its q, dO and out rows this way).
  void (*widen_row)(DType dtype, const void* x, int64_t count, float scale, float* dst);
  // The row products for bf16 K, V and queries on the AVX512-BF16 dot instruction, pairs of
  // elements per multiply-add (the avx512bf16 tier; null on the others). depth and width are
  // multiples of 32, rows at most kMaxRowDotRows.
  // st[j * ld_st + r] = scale * sum_h key[j][h] * q[r][h]: key_dots with bf16 query rows
  // (unscaled, so exact) at q + r * ld_q.
  void (*key_dots_bf16)(const uint16_t* key, int64_t ld_key, int64_t keys, int64_t depth, const uint16_t* q,
                        int64_t ld_q, int64_t rows, float scale, float* st, int64_t ld_st,
                        const uint16_t* next) = nullptr;
  // accumulate_values of bf16 value rows with p rounded to bf16 (as the bf16 engine's P·V).
  void (*accumulate_values_bf16)(const float* p, int64_t ld_p, int64_t keys, int64_t rows, const uint16_t* value,
                                 int64_t ld_value, int64_t width, float* acc, int64_t ld_acc,
                                 const uint16_t* next) = nullptr;
};

constexpr int64_t kMaxRowDotRows = 8;

const SoftmaxKernels& GetSoftmaxKernels(Isa isa);

// The online softmax's step over one tile of logits x[r][c] (r < rows, ld floats apart) whose
// columns are the softmax rows (attention keeps its logits transposed), before exponentiation:
// max[c] becomes the running max over every tile so far; alpha[c] = exp(old max - new max)
// (exactly 1 when the max is unchanged or either is -inf) rescales what was accumulated, and
// sum[c] is rescaled here; sub[c] is what the tile's logits are shifted by before exp (0 for a
// column that has seen only -inf, so masked rows stay exactly 0). tile_max is scratch. The
// exponentiation (exp_columns) and the rescaling of the accumulator stay the caller's, which
// fuses them with its next product. Start with max = -inf and sum = 0.
void UpdateRunningMax(const SoftmaxKernels& kernels, const float* x, int64_t rows, int64_t ld, int64_t cols,
                      float* max, float* sum, float* alpha, float* sub, float* tile_max);

}  // namespace tokamax
