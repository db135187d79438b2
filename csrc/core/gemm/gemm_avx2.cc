// The avx2 ISA tier (AVX2 + FMA + F16C): this file alone is built with -mavx2 -mfma -mf16c.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "csrc/core/gemm/gemm.h"

namespace tokamax {
namespace gemm_avx2 {
constexpr int64_t kMr = 6;
constexpr int64_t kNr = 16;
#include "csrc/core/vec/transpose_avx.inc"
#include "csrc/core/vec/widen_avx2.inc"
#include "csrc/core/gemm/gemm_kernels.inc"

// 16 consecutive B elements of row `b` as two fp32 vectors.
template <typename T>
inline void LoadRow16(const T* b, __m256* lo, __m256* hi) {
  *lo = LoadWiden(b);
  *hi = LoadWiden(b + 8);
}

// 6x16 tile: 12 accumulators, 2 B vectors and 1 broadcast = 15 of the 16 ymm registers.
template <typename T>
void Micro6x16(int64_t depth, const float* a, int64_t lda, const T* b, int64_t ldb, float* c,
               int64_t ldc, bool accumulate) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  const bool packed = ldb == kNr;
  constexpr int64_t kPrefetchBytes = 256;
#define TOKAMAX_GEMM_STEP(P)                                          \
  {                                                                   \
    __m256 b0, b1;                                                    \
    LoadRow16(b + (P) * ldb, &b0, &b1);                               \
    const float* ap = a + (P) * lda;                                  \
    __m256 av = _mm256_broadcast_ss(ap + 0);                          \
    c00 = _mm256_fmadd_ps(av, b0, c00);                               \
    c01 = _mm256_fmadd_ps(av, b1, c01);                               \
    av = _mm256_broadcast_ss(ap + 1);                                 \
    c10 = _mm256_fmadd_ps(av, b0, c10);                               \
    c11 = _mm256_fmadd_ps(av, b1, c11);                               \
    av = _mm256_broadcast_ss(ap + 2);                                 \
    c20 = _mm256_fmadd_ps(av, b0, c20);                               \
    c21 = _mm256_fmadd_ps(av, b1, c21);                               \
    av = _mm256_broadcast_ss(ap + 3);                                 \
    c30 = _mm256_fmadd_ps(av, b0, c30);                               \
    c31 = _mm256_fmadd_ps(av, b1, c31);                               \
    av = _mm256_broadcast_ss(ap + 4);                                 \
    c40 = _mm256_fmadd_ps(av, b0, c40);                               \
    c41 = _mm256_fmadd_ps(av, b1, c41);                               \
    av = _mm256_broadcast_ss(ap + 5);                                 \
    c50 = _mm256_fmadd_ps(av, b0, c50);                               \
    c51 = _mm256_fmadd_ps(av, b1, c51);                               \
  }
  int64_t p = 0;
  if (packed) {
    for (; p + 4 <= depth; p += 4) {
      TOKAMAX_GEMM_STEP(p + 0)
      TOKAMAX_GEMM_STEP(p + 1)
      TOKAMAX_GEMM_STEP(p + 2)
      TOKAMAX_GEMM_STEP(p + 3)
    }
  } else {
    // In place, B's rows are far apart but each row is walked left to right panel by panel:
    // prefetch the same row four cache lines ahead, which the next panels will read.
    for (; p + 4 <= depth; p += 4) {
      for (int64_t r = 0; r < 4; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(b + (p + r) * ldb) + kPrefetchBytes, _MM_HINT_T0);
      }
      TOKAMAX_GEMM_STEP(p + 0)
      TOKAMAX_GEMM_STEP(p + 1)
      TOKAMAX_GEMM_STEP(p + 2)
      TOKAMAX_GEMM_STEP(p + 3)
    }
  }
  for (; p < depth; ++p) TOKAMAX_GEMM_STEP(p)
#undef TOKAMAX_GEMM_STEP
  __m256* rows[kMr][2] = {{&c00, &c01}, {&c10, &c11}, {&c20, &c21},
                              {&c30, &c31}, {&c40, &c41}, {&c50, &c51}};
  for (int64_t i = 0; i < kMr; ++i) {
    float* dst = c + i * ldc;
    __m256 lo = *rows[i][0], hi = *rows[i][1];
    if (accumulate) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(dst));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(dst + 8));
    }
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
  }
}

}  // namespace gemm_avx2

const GemmKernels& GemmKernelsAvx2() {
  using namespace gemm_avx2;
  static const GemmKernels kernels = TOKAMAX_GEMM_KERNELS(Micro6x16);
  return kernels;
}

}  // namespace tokamax
