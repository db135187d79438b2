#include "csrc/core/softmax_kernels.h"

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

}  // namespace tokamax
