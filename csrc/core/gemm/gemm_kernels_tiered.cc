// The GEMM kernels of one ISA tier (GemmKernels, gemm.h): the packers and stores of
// gemm_kernels.inc and one register-blocked micro-kernel, written once over the vector layer
// (csrc/core/vec/vec.h) and compiled per tier. Tiles: scalar 6 x 16 (one float per "vector"),
// avx2 6 x 16 (12 ymm accumulators, 2 B vectors, 1 broadcast of 16 registers), avx512 12 x 32
// (24 zmm accumulators of 32). avx512 has both FmaBroadcastForms (gemm.h).
// tokamax-tiers: scalar avx2 avx512
#include "csrc/core/vec/vec.h"

#include <limits>

#include "csrc/core/base/int_math.h"
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
// How far down B a few-row product read in place asks for its columns' next lines (into L2):
// one 32-deep slice, the in-place blocking of decode-sized products (InPlaceBlocking).
constexpr int64_t kDownRows = 32;

// kRows x kNr tile (kRows <= kMr), two vectors per row. Accumulators are named variables, not
// arrays: with arrays GCC spilled accumulators to the stack (measured 81% of the FMA peak
// against 97%). Rows past kRows are compiled out.
template <int64_t kRows, FmaBroadcastForm kForm, typename T>
void MicroKernel(int64_t depth, const float* a, int64_t lda, const T* b, int64_t ldb, float* c, int64_t ldc,
                 bool accumulate) {
#define TOKAMAX_DECLARE(I) Vec c##I##a = Zero(), c##I##b = Zero();
#define TOKAMAX_FMA(I)                             \
  if constexpr ((I) < kRows && kForm == FmaBroadcastForm::kRegister) { \
    const Vec a##I = Set1(ap[I]);                                       \
    c##I##a = Fma(a##I, b0, c##I##a);                                   \
    c##I##b = Fma(a##I, b1, c##I##b);                                   \
  } else if constexpr ((I) < kRows) {                                   \
    c##I##a = FmaBroadcast(ap + (I), b0, c##I##a);                      \
    c##I##b = FmaBroadcast(ap + (I), b1, c##I##b);                      \
  }
#define TOKAMAX_STEP(P)                          \
  {                                              \
    const Vec b0 = LoadWiden(b + (P) * ldb);     \
    const Vec b1 = LoadWiden(b + (P) * ldb + kLanes); \
    const float* ap = a + (P) * lda;             \
    TOKAMAX_GEMM_ROWS(TOKAMAX_FMA)               \
  }
#define TOKAMAX_STORE(I)                                     \
  if constexpr ((I) < kRows) {                               \
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
    for (int64_t i = 0; i < kRows; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + kLanes), _MM_HINT_T0);
    }
  }
  constexpr int64_t kPrefetchBytes = 256;
  // Bytes of a B row one panel reads: every line of it is fetched ahead. With one line per
  // row, an avx512 panel (128 bytes, two lines) left its second line to the hardware; on a B
  // whose rows start on 128-byte boundaries (any torch tensor with N a multiple of 32) the
  // adjacent-line prefetcher fetched nothing new and that line was a miss (ragged_dot fp32,
  // 64 groups of 64 rows: 24 ms, against 17.5 ms with B shifted by 16 bytes; intel_model167_amx).
  constexpr int64_t kPanelBytes = kNr * static_cast<int64_t>(sizeof(T)) > 64 ? kNr * sizeof(T) : 64;
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
        const char* ahead = reinterpret_cast<const char*>(b + (p + u) * ldb) + kPrefetchBytes;
        _mm_prefetch(ahead, _MM_HINT_T0);
        if constexpr (kPanelBytes > 64) _mm_prefetch(ahead + 64, _MM_HINT_T0);
        if constexpr (kRows <= 4) {
          // A few-row tile (decode-sized products) spends next to nothing per B row, so its walk
          // down the panel waits on each row's first line: ask for the panel's line kDownRows
          // rows ahead too, into L2. amd_zen4_avx512bf16, 2 threads, alternating processes, min
          // of 3-4: ragged_dot M=64 K=2048 N=1024, 16 groups of 4, fp32 6.9-7.6 -> 4.4-4.7 ms,
          // bf16 4.9-5.2 -> 3.3-4.0 ms; gated_linear_unit M=4 K=2048 N=5632 0-13% faster;
          // fused_experts at 4 tokens within noise. Not measured on Intel.
          const char* down = reinterpret_cast<const char*>(b + (p + u + kDownRows) * ldb);
          _mm_prefetch(down, _MM_HINT_T1);
          if constexpr (kPanelBytes > 64) _mm_prefetch(down + 64, _MM_HINT_T1);
        }
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

// GemmKernels' micro-kernel: a short tile (a region's last rows) on a narrower kernel where the
// tier has one. avx512: a 5-row group as a 12-row tile spends 7/12 of its FMAs on padding; 4
// and 8 rows keep 8 and 16 accumulators, enough to fill both FMA pipes. avx2's 6-row tile has
// no narrower one that would (3 rows: 6 accumulators).
template <FmaBroadcastForm kForm, typename T>
void MicroTile(int64_t rows, int64_t depth, const float* a, int64_t lda, const T* b, int64_t ldb, float* c,
               int64_t ldc, bool accumulate) {
  if constexpr (kMr == 12) {
    if (rows <= 4) return MicroKernel<4, kForm>(depth, a, lda, b, ldb, c, ldc, accumulate);
    if (rows <= 8) return MicroKernel<8, kForm>(depth, a, lda, b, ldb, c, ldc, accumulate);
  }
  MicroKernel<kMr, kForm>(depth, a, lda, b, ldb, c, ldc, accumulate);
}

// GemmKernels::wide_f32: kRows x (kVecs * kLanes) blocks, each element an FMA chain down the
// depth from zero (then added to c when accumulating), as MicroKernel's: the same bits. A block
// reads kVecs vectors of one B row a step, and asks for the row's next block (into L1) and for
// its own columns kDownRows rows down (into L2: the next slice), as MicroKernel's few-row tiles do.
template <int64_t kRows, int64_t kVecs>
[[gnu::always_inline]] inline void WideBlock(int64_t depth, const float* a, int64_t lda, const float* b, int64_t ldb,
                                             float* c, int64_t ldc, int64_t group_stride, bool accumulate) {
  Vec acc[kRows * kVecs];
#pragma GCC unroll 24
  for (int64_t i = 0; i < kRows * kVecs; ++i) acc[i] = Zero();
  constexpr int64_t kLines = (kVecs * kLanes * static_cast<int64_t>(sizeof(float)) + 63) / 64;
  for (int64_t p = 0; p < depth; ++p) {
    const float* row = b + p * ldb;
    {
      const char* ahead = reinterpret_cast<const char*>(row + kVecs * kLanes);
      const char* down = reinterpret_cast<const char*>(row + kDownRows * ldb);
#pragma GCC unroll 16
      for (int64_t l = 0; l < kLines; ++l) {
        _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
        _mm_prefetch(down + 64 * l, _MM_HINT_T1);
      }
    }
    Vec v[kVecs];
#pragma GCC unroll 16
    for (int64_t q = 0; q < kVecs; ++q) v[q] = LoadWiden(row + q * kLanes);
#pragma GCC unroll 4
    for (int64_t i = 0; i < kRows; ++i) {
      const Vec x = Set1(a[p * lda + i]);
#pragma GCC unroll 16
      for (int64_t q = 0; q < kVecs; ++q) acc[i * kVecs + q] = Fma(x, v[q], acc[i * kVecs + q]);
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 16
    for (int64_t q = 0; q < kVecs; ++q) {
      const int64_t j = q * kLanes;
      float* dst = c + i * ldc + (j / kNr) * group_stride + j % kNr;
      Vec x = acc[i * kVecs + q];
      if (accumulate) x = Add(x, Load(dst));
      Store(dst, x);
    }
  }
}

template <int64_t kRows>
void WideRows(int64_t cols, int64_t depth, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
              int64_t ldc, int64_t group_stride, bool accumulate) {
  constexpr int64_t kPanelVecs = kNr / kLanes;
  // As many panels as keep 3/2 of the tier's accumulator budget (24 of 32 zmm, 12 of 16 ymm), at
  // most 16 vectors: 1 row reads 256 fp32 columns of a B row a step, 4 rows 96.
  constexpr int64_t kVecs =
      std::min<int64_t>(16, std::max<int64_t>(kAccumulatorRegisters * 3 / 2 / kRows / kPanelVecs, 1) * kPanelVecs);
  int64_t j = 0;
  for (; j + kVecs * kLanes <= cols; j += kVecs * kLanes) {
    WideBlock<kRows, kVecs>(depth, a, lda, b + j, ldb, c + (j / kNr) * group_stride, ldc, group_stride, accumulate);
  }
  for (; j < cols; j += kNr) {
    WideBlock<kRows, kPanelVecs>(depth, a, lda, b + j, ldb, c + (j / kNr) * group_stride, ldc, group_stride,
                                 accumulate);
  }
}

void WideF32(int64_t rows, int64_t cols, int64_t depth, const float* a, int64_t lda, const float* b, int64_t ldb,
             float* c, int64_t ldc, int64_t group_stride, bool accumulate) {
  DispatchRows<kGemmWideRows>(rows, [&](auto n) {
    WideRows<decltype(n)::value>(cols, depth, a, lda, b, ldb, c, ldc, group_stride, accumulate);
  });
}
#endif

}  // namespace gemm

const GemmKernels& GemmKernelTable(FmaBroadcastForm form) {
  using namespace gemm;
#if defined(TOKAMAX_TIER_SCALAR)
  static const GemmKernels kernels = TOKAMAX_GEMM_KERNELS(MicroScalar, nullptr);
#elif defined(TOKAMAX_TIER_AVX2)
  // One form: the 6 x 16 tile's 12 embedded broadcasts already reach the 256-bit FMA peak (Intel
  // Xeon model 167, L1-resident panels: 111 GFLOP/s a core in either form).
  static const GemmKernels kernels = TOKAMAX_GEMM_KERNELS(MicroTile<FmaBroadcastForm::kEmbedded>, &WideF32);
#else
  static const GemmKernels embedded = TOKAMAX_GEMM_KERNELS(MicroTile<FmaBroadcastForm::kEmbedded>, &WideF32);
  static const GemmKernels shared = TOKAMAX_GEMM_KERNELS(MicroTile<FmaBroadcastForm::kRegister>, &WideF32);
  const GemmKernels& kernels = form == FmaBroadcastForm::kRegister ? shared : embedded;
#endif
  (void)form;
  return kernels;
}

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
