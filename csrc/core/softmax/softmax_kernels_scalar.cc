// The scalar tier of SoftmaxKernels: one float per "vector", std::exp.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "csrc/core/softmax/softmax_kernels.h"

namespace tokamax {
namespace softmax_scalar {

using Vec = float;
constexpr int64_t kLanes = 1;
inline Vec Load(const float* p) { return *p; }
inline void Store(float* p, Vec v) { *p = v; }
inline Vec Set1(float v) { return v; }
inline Vec Add(Vec a, Vec b) { return a + b; }
inline Vec Sub(Vec a, Vec b) { return a - b; }
inline Vec Mul(Vec a, Vec b) { return a * b; }
inline Vec Max(Vec a, Vec b) { return std::max(a, b); }
inline Vec InRange(Vec x, Vec r, Vec lo, Vec hi) { return lo <= r && r < hi ? x : -__builtin_inff(); }
inline Vec Exp(Vec x) { return x < kExpFlushBelow ? 0.0f : std::exp(x); }
inline Vec Fma(Vec a, Vec b, Vec c) { return a * b + c; }
template <typename T>
inline Vec LoadWiden(const T* p) { return LoadAsFloat(p); }
inline Vec SumLanes(const Vec* v) { return v[0]; }
constexpr int64_t kAccumulatorRegisters = 8;

#include "csrc/core/vec/transpose_scalar.inc"

#include "csrc/core/softmax/softmax_kernels.inc"

}  // namespace softmax_scalar

const SoftmaxKernels& SoftmaxKernelsScalar() {
  using namespace softmax_scalar;
  static const SoftmaxKernels kernels = CommonKernelTable();
  return kernels;
}

}  // namespace tokamax
