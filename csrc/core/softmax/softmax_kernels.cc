#include "csrc/core/softmax/softmax_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tokamax {

const SoftmaxKernels& SoftmaxKernelsScalar();
const SoftmaxKernels& SoftmaxKernelsAvx2();
const SoftmaxKernels& SoftmaxKernelsAvx512();
const SoftmaxKernels& SoftmaxKernelsAvx512Bf16();

// A tier this build lacks (IsaBuilt) gets the scalar table.
const SoftmaxKernels& GetSoftmaxKernels(Isa isa) {
  switch (isa) {
#ifdef TOKAMAX_HAVE_AVX512
    // The amx tier keeps the widening row products: on the Intel VM it was measured on,
    // vdpbf16ps ran at half the FMA's rate per multiply-add, and the dot version was slower.
    case Isa::kAvx512:
    case Isa::kAmx: return SoftmaxKernelsAvx512();
#endif
#ifdef TOKAMAX_HAVE_AVX512BF16
    case Isa::kAvx512Bf16: return SoftmaxKernelsAvx512Bf16();
#endif
#ifdef TOKAMAX_HAVE_AVX2
    case Isa::kAvx2: return SoftmaxKernelsAvx2();
#endif
    default: break;
  }
  return SoftmaxKernelsScalar();
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
