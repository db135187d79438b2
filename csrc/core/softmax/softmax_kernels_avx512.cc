// The avx512 tier of SoftmaxKernels: 16 lanes; the same polynomial as avx2, 2^n by scalef.
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include "csrc/core/softmax/softmax_kernels.h"

namespace tokamax {
namespace softmax_avx512 {

#include "csrc/core/softmax/softmax_avx512.inc"
#include "csrc/core/vec/exp_avx512.inc"

#include "csrc/core/vec/transpose_avx.inc"
#include "csrc/core/softmax/softmax_kernels.inc"

}  // namespace softmax_avx512

const SoftmaxKernels& SoftmaxKernelsAvx512() {
  using namespace softmax_avx512;
  static const SoftmaxKernels kernels = CommonKernelTable();
  return kernels;
}

}  // namespace tokamax
