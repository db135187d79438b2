#include "csrc/core/softmax/softmax_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "csrc/core/vec/tiers.h"

namespace tokamax {

TOKAMAX_DECLARE_IN_TIERS(const SoftmaxKernels& SoftmaxKernelTable();)

// A tier this build lacks (IsaBuilt) gets the scalar table. The avx512bf16 and amx tiers add
// nothing to fp32 column loops: they run the avx512 one.
const SoftmaxKernels& GetSoftmaxKernels(Isa isa) {
  TOKAMAX_RETURN_BY_VECTOR_WIDTH(isa, SoftmaxKernelTable());
}

void UpdateRunningMax(const SoftmaxKernels& kernels, const float* x, int64_t rows, int64_t ld, int64_t cols,
                      float* max, float* sum, float* alpha, float* sub, float* tile_max) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::fill(tile_max, tile_max + cols, kNegInf);
  kernels.column_max(x, rows, ld, cols, tile_max);
  for (int64_t c = 0; c < cols; ++c) {
    const float new_max = std::max(max[c], tile_max[c]);
    alpha[c] = 1.0f;
    if (new_max != kNegInf && max[c] != kNegInf && new_max != max[c]) alpha[c] = std::exp(max[c] - new_max);
    sub[c] = new_max == kNegInf ? 0.0f : new_max;
    max[c] = new_max;
    sum[c] *= alpha[c];
  }
}

}  // namespace tokamax
