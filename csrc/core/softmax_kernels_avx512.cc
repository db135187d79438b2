// The avx512 tier of SoftmaxKernels: 16 lanes; the same polynomial as avx2, 2^n by scalef.
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

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
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#include "csrc/core/widen_avx512.inc"
constexpr int64_t kAccumulatorRegisters = 16;  // of 32

// Lane i of the result = the sum of v[i]'s 16 lanes: pairs of vectors are interleaved and added
// within 128-bit lanes (twice), then across them (twice): 45 instructions for 16 sums, each
// vector summed in the same order wherever it sits.
[[gnu::always_inline]] inline Vec SumLanes(const Vec* v) {
  Vec a[8], b[4];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_castps_pd(a[2 * i]), hi = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // b[i], 128-bit lane L: the lane-L partial sums of v[4i .. 4i + 3].
  const Vec c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const Vec c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

#include "csrc/core/exp_avx512.inc"

#include "csrc/core/transpose_avx.inc"
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
