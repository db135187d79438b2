// The avx512 tier of SoftmaxKernels: 16 lanes; the same polynomial as avx2, 2^n by scalef.
#include <immintrin.h>

#include <algorithm>

#include "csrc/core/softmax_kernels.h"

namespace tokamax {
namespace softmax_avx512 {

using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Set1(float v) { return _mm512_set1_ps(v); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec InRange(Vec x, Vec r, Vec lo, Vec hi) {
  const __mmask16 in = _mm512_cmp_ps_mask(lo, r, _CMP_LE_OQ) & _mm512_cmp_ps_mask(r, hi, _CMP_LT_OQ);
  return _mm512_mask_mov_ps(_mm512_set1_ps(-__builtin_inff()), in, x);
}

#include "csrc/core/exp_avx512.inc"

#include "csrc/core/transpose8x8_avx.inc"
#include "csrc/core/softmax_kernels.inc"

}  // namespace softmax_avx512

const SoftmaxKernels& SoftmaxKernelsAvx512() {
  using namespace softmax_avx512;
  static const SoftmaxKernels kernels = {&ColumnMax,        &ExpColumns,         &MaskColumns,
                                          &ScaleRows,        &TransposePanels,    &SoftmaxGradColumns,
                                          &KeyDots,          &AccumulateValues, &ScaleColumns};
  return kernels;
}

}  // namespace tokamax
