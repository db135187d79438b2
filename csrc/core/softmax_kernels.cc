#include "csrc/core/softmax_kernels.h"

namespace tokamax {

const SoftmaxKernels& SoftmaxKernelsScalar();
const SoftmaxKernels& SoftmaxKernelsAvx2();
const SoftmaxKernels& SoftmaxKernelsAvx512();

const SoftmaxKernels& GetSoftmaxKernels(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
    case Isa::kAmx: return SoftmaxKernelsAvx512();
    case Isa::kAvx2: return SoftmaxKernelsAvx2();
    case Isa::kScalar: break;
  }
  return SoftmaxKernelsScalar();
}

}  // namespace tokamax
