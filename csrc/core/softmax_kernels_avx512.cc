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

inline Vec Exp(Vec x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFlushBelow), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpFlushBelow)), _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, n));
}

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
