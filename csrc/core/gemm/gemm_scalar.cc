// The scalar ISA tier: portable C++ built without SIMD flags (also the aarch64 fallback).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "csrc/core/gemm/gemm.h"

namespace tokamax {
namespace gemm_scalar {
constexpr int64_t kMr = 6;
constexpr int64_t kNr = 16;
#include "csrc/core/vec/transpose_scalar.inc"
#include "csrc/core/gemm/gemm_kernels.inc"
}  // namespace gemm_scalar

const GemmKernels& GemmKernelsScalar() {
  using namespace gemm_scalar;
  static const GemmKernels kernels = TOKAMAX_GEMM_KERNELS(MicroScalar);
  return kernels;
}

}  // namespace tokamax
