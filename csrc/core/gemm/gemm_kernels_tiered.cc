// The GEMM kernels of one ISA tier (GemmKernels, gemm.h): the packers and stores of
// gemm_kernels.inc and one register-blocked micro-kernel, written once over the vector layer
// (csrc/core/vec/vec.h) and compiled per tier. Tiles: scalar 6 x 16 (one float per "vector"),
// avx2 6 x 16 (12 ymm accumulators, 2 B vectors, 1 broadcast of 16 registers), avx512 12 x 32
// (24 zmm accumulators of 32).
// tokamax-tiers: scalar avx2 avx512
#include "csrc/core/vec/vec.h"

#include <limits>

#include "csrc/core/gemm/gemm.h"

namespace tokamax {
namespace TOKAMAX_TIER_NAMESPACE {
namespace gemm {

#if defined(TOKAMAX_TIER_SCALAR)
constexpr int64_t kMr = 6;
constexpr int64_t kNr = 16;
#elif defined(TOKAMAX_TIER_AVX2)
constexpr int64_t kMr = 6;
constexpr int64_t kNr = 2 * kLanes;
// Depth steps per loop iteration, and per batch of B-row prefetches when B is read in place.
constexpr int64_t kDepthUnroll = 4;
constexpr bool kPrefetchAccumulatedTile = false;
#define TOKAMAX_GEMM_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#else
constexpr int64_t kMr = 12;
constexpr int64_t kNr = 2 * kLanes;
constexpr int64_t kDepthUnroll = 2;
// Accumulated sums (attention's dK/dV) live beyond L1 and C is read only after the loop: start
// fetching the tile first so the final loads do not stall.
constexpr bool kPrefetchAccumulatedTile = true;
#define TOKAMAX_GEMM_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#endif

#include "csrc/core/gemm/gemm_kernels.inc"

#if !defined(TOKAMAX_TIER_SCALAR)
// kMr x kNr tile, two vectors per row. Accumulators are named variables, not arrays: with
// arrays GCC spilled accumulators to the stack (measured 81% of the FMA peak against 97%).
template <typename T>
void MicroKernel(int64_t depth, const float* a, int64_t lda, const T* b, int64_t ldb, float* c, int64_t ldc,
                 bool accumulate) {
#define TOKAMAX_DECLARE(I) Vec c##I##a = Zero(), c##I##b = Zero();
#define TOKAMAX_FMA(I)                             \
  c##I##a = FmaBroadcast(ap + (I), b0, c##I##a); \
  c##I##b = FmaBroadcast(ap + (I), b1, c##I##b);
#define TOKAMAX_STEP(P)                          \
  {                                              \
    const Vec b0 = LoadWiden(b + (P) * ldb);     \
    const Vec b1 = LoadWiden(b + (P) * ldb + kLanes); \
    const float* ap = a + (P) * lda;             \
    TOKAMAX_GEMM_ROWS(TOKAMAX_FMA)               \
  }
#define TOKAMAX_STORE(I)                                     \
  {                                                          \
    float* dst = c + (I) * ldc;                              \
    if (accumulate) {                                        \
      c##I##a = Add(c##I##a, Load(dst));                     \
      c##I##b = Add(c##I##b, Load(dst + kLanes));            \
    }                                                        \
    Store(dst, c##I##a);                                     \
    Store(dst + kLanes, c##I##b);                            \
  }
  TOKAMAX_GEMM_ROWS(TOKAMAX_DECLARE)
  if (kPrefetchAccumulatedTile && accumulate) {
    for (int64_t i = 0; i < kMr; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + kLanes), _MM_HINT_T0);
    }
  }
  constexpr int64_t kPrefetchBytes = 256;
  int64_t p = 0;
  if (ldb == kNr) {
    for (; p + kDepthUnroll <= depth; p += kDepthUnroll) {
#pragma GCC unroll 4
      for (int64_t u = 0; u < kDepthUnroll; ++u) TOKAMAX_STEP(p + u)
    }
  } else {
    // In place, B's rows are far apart but each row is walked left to right panel by panel:
    // prefetch each row a few cache lines ahead, where the next panels read.
    for (; p + kDepthUnroll <= depth; p += kDepthUnroll) {
#pragma GCC unroll 4
      for (int64_t u = 0; u < kDepthUnroll; ++u) {
        _mm_prefetch(reinterpret_cast<const char*>(b + (p + u) * ldb) + kPrefetchBytes, _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (int64_t u = 0; u < kDepthUnroll; ++u) TOKAMAX_STEP(p + u)
    }
  }
  for (; p < depth; ++p) TOKAMAX_STEP(p)
  TOKAMAX_GEMM_ROWS(TOKAMAX_STORE)
#undef TOKAMAX_STORE
#undef TOKAMAX_STEP
#undef TOKAMAX_FMA
#undef TOKAMAX_DECLARE
}
#undef TOKAMAX_GEMM_ROWS
#endif

}  // namespace gemm

const GemmKernels& GemmKernelTable() {
  using namespace gemm;
#if defined(TOKAMAX_TIER_SCALAR)
  static const GemmKernels kernels = TOKAMAX_GEMM_KERNELS(MicroScalar);
#else
  static const GemmKernels kernels = TOKAMAX_GEMM_KERNELS(MicroKernel);
#endif
  return kernels;
}

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
