// The avx512 ISA tier (AVX-512F on top of avx2): this file alone is built with -mavx512f.
// A 12x32 tile: 24 zmm accumulators, 2 B vectors and 1 broadcast of the 32 zmm registers.
#include <immintrin.h>

#include <cmath>

#include "csrc/core/gemm.h"

namespace tokamax {
namespace gemm_avx512 {
constexpr int64_t kMr = 12;
constexpr int64_t kNr = 32;
#include "csrc/core/gemm_kernels.inc"

inline void LoadRow32(const float* b, __m512* lo, __m512* hi) {
  *lo = _mm512_loadu_ps(b);
  *hi = _mm512_loadu_ps(b + 16);
}

inline void LoadRow32(const BFloat16Bits* b, __m512* lo, __m512* hi) {
  // bf16 is the top half of an fp32: zero-extend to 32 bits and shift left by 16.
  const __m256i lo_raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i hi_raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(lo_raw), 16));
  *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi_raw), 16));
}

inline void LoadRow32(const Float16Bits* b, __m512* lo, __m512* hi) {
  *lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  *hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
}

template <typename T>
void Micro12x32(int64_t depth, const float* a, const T* b, int64_t ldb, float* c, int64_t ldc,
                bool accumulate) {
  __m512 acc0[kMr], acc1[kMr];
#pragma GCC unroll 12
  for (int i = 0; i < kMr; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  const bool in_place = ldb != kNr;
  constexpr int64_t kPrefetchBytes = 256;
  for (int64_t p = 0; p < depth; ++p) {
    if (in_place) _mm_prefetch(reinterpret_cast<const char*>(b + p * ldb) + kPrefetchBytes, _MM_HINT_T0);
    __m512 b0, b1;
    LoadRow32(b + p * ldb, &b0, &b1);
    const float* ap = a + p * kMr;
#pragma GCC unroll 12
    for (int i = 0; i < kMr; ++i) {
      const __m512 av = _mm512_set1_ps(ap[i]);
      acc0[i] = _mm512_fmadd_ps(av, b0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(av, b1, acc1[i]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < kMr; ++i) {
    float* dst = c + i * ldc;
    __m512 lo = acc0[i], hi = acc1[i];
    if (accumulate) {
      lo = _mm512_add_ps(lo, _mm512_loadu_ps(dst));
      hi = _mm512_add_ps(hi, _mm512_loadu_ps(dst + 16));
    }
    _mm512_storeu_ps(dst, lo);
    _mm512_storeu_ps(dst + 16, hi);
  }
}

void MicroF32(int64_t depth, const float* a, const float* b, int64_t ldb, float* c, int64_t ldc,
              bool accumulate) {
  Micro12x32(depth, a, b, ldb, c, ldc, accumulate);
}
void MicroBF16(int64_t depth, const float* a, const uint16_t* b, int64_t ldb, float* c,
               int64_t ldc, bool accumulate) {
  Micro12x32(depth, a, reinterpret_cast<const BFloat16Bits*>(b), ldb, c, ldc, accumulate);
}
void MicroF16(int64_t depth, const float* a, const uint16_t* b, int64_t ldb, float* c,
              int64_t ldc, bool accumulate) {
  Micro12x32(depth, a, reinterpret_cast<const Float16Bits*>(b), ldb, c, ldc, accumulate);
}

}  // namespace gemm_avx512

const GemmKernels& GemmKernelsAvx512() {
  static const GemmKernels kernels = {
      gemm_avx512::kMr,        gemm_avx512::kNr,       &gemm_avx512::PackA,
      &gemm_avx512::PackB,     &gemm_avx512::MicroF32, &gemm_avx512::MicroBF16,
      &gemm_avx512::MicroF16,  &gemm_avx512::StoreC,
  };
  return kernels;
}

}  // namespace tokamax
