// Column-wise softmax pieces on fp32 tiles, one table per ISA tier (softmax_kernels_tiered.cc).
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

struct SoftmaxKernels {
  // max[c] = max(max[c], x[r][c]) over r < rows.
  void (*column_max)(const float* x, int64_t rows, int64_t ld, int64_t cols, float* max);
  // x[r][c] = exp(x[r][c] - sub[c]); sums[c] += x[r][c] when sums is not null. sub is finite.
  void (*exp_columns)(float* x, int64_t rows, int64_t ld, int64_t cols, const float* sub, float* sums);
  // x[r][c] = -inf unless lo[c] <= r < hi[c]: a range mask (causal, window, lengths) applied
  // to a tile, with lo/hi relative to its first row and exact small integers in float.
  void (*mask_columns)(float* x, int64_t rows, int64_t ld, int64_t cols, const float* lo, const float* hi);
  // x[r][c] = cap · tanh(x[r][c] / cap) for r < rows, c < cols (any cols <= ld): a logits soft
  // cap; with `slope` not null, slope[r * ld_slope + c] = 1 - tanh²(x[r][c] / cap), the cap's
  // derivative, accurate however saturated (vec.h's Tanh).
  void (*soft_cap)(float* x, int64_t rows, int64_t ld, int64_t cols, float cap, float* slope, int64_t ld_slope);
  // x[r][e] *= scale[r] for r < rows, e < width, skipping rows whose scale is exactly 1.
  void (*scale_rows)(float* x, int64_t ld, int64_t rows, int64_t width, const float* scale);
  // dst[q][h][j] = x[(q * nr + j) * ld + h] for h < cols, zero where q * nr + j >= rows: fp32
  // rows transposed into the nr-wide B panels of a GEMM whose depth is `cols` (nr a multiple
  // of 8). Attention packs query and output-gradient rows this way.
  void (*transpose_panels)(const float* x, int64_t ld, int64_t rows, int64_t cols, int64_t nr, float* dst);
  // dp[r][c] = p[r][c] * (dp[r][c] - d[c]): the softmax gradient given dp = dO·Vᵀ.
  void (*softmax_grad_columns)(const float* p, float* dp, int64_t rows, int64_t ld, int64_t cols,
                               const float* d);
  // x[r][c] *= scale[c] for r < rows, c < cols: scale_rows for a transposed accumulator.
  void (*scale_columns)(float* x, int64_t ld, int64_t rows, int64_t cols, const float* scale);
  // dst[h] = scale * x[h] for h < count: one contiguous row of `dtype` widened to fp32, the same
  // bits as the scalar product (attention gathers its q, dO and out rows this way).
  void (*widen_row)(DType dtype, const void* x, int64_t count, float scale, float* dst);
};

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
