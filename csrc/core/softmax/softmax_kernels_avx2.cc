// The avx2 tier of SoftmaxKernels: 8 lanes, a Cephes-style polynomial exp.
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include "csrc/core/softmax/softmax_kernels.h"

namespace tokamax {
namespace softmax_avx2 {

using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Set1(float v) { return _mm256_set1_ps(v); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec InRange(Vec x, Vec r, Vec lo, Vec hi) {
  const __m256 in = _mm256_and_ps(_mm256_cmp_ps(lo, r, _CMP_LE_OQ), _mm256_cmp_ps(r, hi, _CMP_LT_OQ));
  return _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), x, in);
}
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#include "csrc/core/vec/widen_avx2.inc"
constexpr int64_t kAccumulatorRegisters = 8;  // of 16

// Lane i of the result = the sum of v[i]'s 8 lanes: pairs interleaved and added within 128-bit
// lanes (twice), then across the two (once), each vector summed in the same order.
[[gnu::always_inline]] inline Vec SumLanes(const Vec* v) {
  Vec a[4], b[2];
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d lo = _mm256_castps_pd(a[2 * i]), hi = _mm256_castps_pd(a[2 * i + 1]);
    b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(lo, hi)), _mm256_castpd_ps(_mm256_unpackhi_pd(lo, hi)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

// exp(x) = 2^n · e^r with n = round(x·log2 e) and |r| <= ln2/2; e^r by a degree-6 polynomial
// (relative error ~2 ulp). Inputs below kExpFlushBelow (including -inf) give exactly 0.
inline Vec Exp(Vec x) {
  const __m256 flush = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFlushBelow), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpFlushBelow)), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
  return _mm256_andnot_ps(flush, y);
}

#include "csrc/core/vec/transpose_avx.inc"
#include "csrc/core/softmax/softmax_kernels.inc"

}  // namespace softmax_avx2

const SoftmaxKernels& SoftmaxKernelsAvx2() {
  using namespace softmax_avx2;
  static const SoftmaxKernels kernels = CommonKernelTable();
  return kernels;
}

}  // namespace tokamax
