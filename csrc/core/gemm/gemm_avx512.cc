// The avx512 ISA tier (AVX-512F on top of avx2): this file alone is built with -mavx512f.
// A 12x32 tile: 24 zmm accumulators, 2 B vectors and 1 broadcast of the 32 zmm registers.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "csrc/core/gemm/gemm.h"

namespace tokamax {
namespace gemm_avx512 {
constexpr int64_t kMr = 12;
constexpr int64_t kNr = 32;
#include "csrc/core/vec/transpose_avx.inc"
#include "csrc/core/vec/widen_avx512.inc"
#include "csrc/core/gemm/gemm_kernels.inc"

// 32 consecutive B elements of row `b` as two fp32 vectors.
template <typename T>
inline void LoadRow32(const T* b, __m512* lo, __m512* hi) {
  *lo = LoadWiden(b);
  *hi = LoadWiden(b + 16);
}

// c + broadcast(*a) · b, the broadcast folded into the FMA's memory operand ({1to16}). GCC
// turns _mm512_set1_ps into one vbroadcastss per row shared by the row's two FMAs: 41 fused
// uops per depth step instead of 24. Both reach ~97% of the FMA peak in L1 at best, but in
// typical runs on a shared core the front end limits the longer form (93-95 against 103-109
// GFLOP/s in L1; attention 8-10% faster).
inline __m512 FmaBroadcast(const float* a, __m512 b, __m512 c) {
  asm("vfmadd231ps %[a]%{1to16%}, %[b], %[c]" : [c] "+v"(c) : [b] "v"(b), [a] "m"(*a));
  return c;
}

// Accumulators are named variables, not arrays, and the in-place test is hoisted out of the
// loop: with arrays GCC spilled accumulators to the stack (measured 81% of peak vs 97%).
template <typename T>
void Micro12x32(int64_t depth, const float* a, int64_t lda, const T* b, int64_t ldb, float* c,
                int64_t ldc, bool accumulate) {
#define TOKAMAX_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define TOKAMAX_DECLARE(I) __m512 c##I##a = _mm512_setzero_ps(), c##I##b = _mm512_setzero_ps();
#define TOKAMAX_FMA(I)                          \
  {                                             \
    c##I##a = FmaBroadcast(ap + (I), b0, c##I##a); \
    c##I##b = FmaBroadcast(ap + (I), b1, c##I##b); \
  }
#define TOKAMAX_STEP(P)                  \
  {                                      \
    __m512 b0, b1;                       \
    LoadRow32(b + (P) * ldb, &b0, &b1);  \
    const float* ap = a + (P) * lda;     \
    TOKAMAX_ROWS(TOKAMAX_FMA)            \
  }
#define TOKAMAX_STORE(I)                                                 \
  {                                                                      \
    float* dst = c + (I) * ldc;                                          \
    if (accumulate) {                                                    \
      c##I##a = _mm512_add_ps(c##I##a, _mm512_loadu_ps(dst));            \
      c##I##b = _mm512_add_ps(c##I##b, _mm512_loadu_ps(dst + 16));       \
    }                                                                    \
    _mm512_storeu_ps(dst, c##I##a);                                      \
    _mm512_storeu_ps(dst + 16, c##I##b);                                 \
  }
  TOKAMAX_ROWS(TOKAMAX_DECLARE)
  if (accumulate) {
    // C is read only after the loop, and accumulated sums (attention's dK/dV) live beyond L1:
    // start fetching the tile now so the final loads do not stall.
    for (int64_t i = 0; i < kMr; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + 16), _MM_HINT_T0);
    }
  }
  constexpr int64_t kPrefetchBytes = 256;
  int64_t p = 0;
  if (ldb == kNr) {
    for (; p + 2 <= depth; p += 2) {
      TOKAMAX_STEP(p)
      TOKAMAX_STEP(p + 1)
    }
  } else {
    // In place: prefetch each B row a few cache lines ahead, where the next panels read.
    for (; p + 2 <= depth; p += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(b + p * ldb) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + (p + 1) * ldb) + kPrefetchBytes, _MM_HINT_T0);
      TOKAMAX_STEP(p)
      TOKAMAX_STEP(p + 1)
    }
  }
  for (; p < depth; ++p) TOKAMAX_STEP(p)
  TOKAMAX_ROWS(TOKAMAX_STORE)
#undef TOKAMAX_STORE
#undef TOKAMAX_STEP
#undef TOKAMAX_FMA
#undef TOKAMAX_DECLARE
#undef TOKAMAX_ROWS
}

}  // namespace gemm_avx512

const GemmKernels& GemmKernelsAvx512() {
  using namespace gemm_avx512;
  static const GemmKernels kernels = TOKAMAX_GEMM_KERNELS(Micro12x32);
  return kernels;
}

}  // namespace tokamax
