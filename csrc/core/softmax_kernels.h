// Column-wise softmax pieces on fp32 tiles, one set per ISA tier.
//
// Attention keeps its logits transposed, x[key][query row] (keys are the rows of the GEMM that
// makes them), so every per-query reduction runs down a column and vectorizes across queries
// without horizontal sums. `cols` is a multiple of 16 and at most `ld`.
#pragma once

#include <cstdint>

#include "csrc/core/isa.h"

namespace tokamax {

// Inputs below this give exp() == 0 exactly (masked logits are -inf); every tier flushes here.
constexpr float kExpFlushBelow = -87.0f;

struct SoftmaxKernels {
  // max[c] = max(max[c], x[r][c]) over r < rows.
  void (*column_max)(const float* x, int64_t rows, int64_t ld, int64_t cols, float* max);
  // x[r][c] = exp(x[r][c] - sub[c]); sums[c] += x[r][c] when sums is not null. sub is finite.
  void (*exp_columns)(float* x, int64_t rows, int64_t ld, int64_t cols, const float* sub, float* sums);
  // dp[r][c] = p[r][c] * (dp[r][c] - d[c]): the softmax gradient given dp = dO·Vᵀ.
  void (*softmax_grad_columns)(const float* p, float* dp, int64_t rows, int64_t ld, int64_t cols,
                               const float* d);
};

const SoftmaxKernels& GetSoftmaxKernels(Isa isa);

}  // namespace tokamax
