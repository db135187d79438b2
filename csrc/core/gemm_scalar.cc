// The scalar ISA tier: portable C++ built without SIMD flags (also the aarch64 fallback).
#include <cmath>

#include "csrc/core/gemm.h"

namespace tokamax {
namespace gemm_scalar {
constexpr int64_t kMr = 6;
constexpr int64_t kNr = 16;
#include "csrc/core/gemm_kernels.inc"
}  // namespace gemm_scalar

const GemmKernels& GemmKernelsScalar() {
  static const GemmKernels kernels = {
      gemm_scalar::kMr,             gemm_scalar::kNr,
      &gemm_scalar::PackA,          &gemm_scalar::PackB,          &gemm_scalar::MicroScalarF32,
      &gemm_scalar::MicroScalarBF16, &gemm_scalar::MicroScalarF16, &gemm_scalar::StoreC,
  };
  return kernels;
}

}  // namespace tokamax
