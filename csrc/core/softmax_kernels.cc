#include "csrc/core/softmax_kernels.h"

namespace tokamax {

const SoftmaxKernels& SoftmaxKernelsScalar();
const SoftmaxKernels& SoftmaxKernelsAvx2();
const SoftmaxKernels& SoftmaxKernelsAvx512();
const SoftmaxKernels& SoftmaxKernelsAvx512Bf16();

const SoftmaxKernels& GetSoftmaxKernels(Isa isa) {
  switch (isa) {
    // The amx tier keeps the widening row products: on the Intel VM it was measured on,
    // vdpbf16ps ran at half the FMA's rate per multiply-add, and the dot version was slower.
    case Isa::kAvx512:
    case Isa::kAmx: return SoftmaxKernelsAvx512();
    case Isa::kAvx512Bf16: return SoftmaxKernelsAvx512Bf16();
    case Isa::kAvx2: return SoftmaxKernelsAvx2();
    case Isa::kScalar: break;
  }
  return SoftmaxKernelsScalar();
}

}  // namespace tokamax
