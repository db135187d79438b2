// Packed, register-blocked GEMM core shared by every op: C = A · B on strided matrices of
// fp32, bf16 or fp16, accumulated in fp32 and written in C's dtype.
//
// Blocking follows Goto/BLIS: for each block_n-wide column block and block_k-deep slice of K,
// B is packed into 16-wide fp32 micro-panels (or read in place when packing would not pay),
// A is packed block_m rows at a time into 6-row micro-panels, and a 6x16 micro-kernel
// accumulates into an fp32 tile buffer that is converted into C at the end. The order in
// which each output element accumulates depends only on block_k and the ISA tier, never on
// the tiling or the thread count, so results are bitwise reproducible.
#pragma once

#include <cmath>
#include <cstdint>

#include "csrc/core/gemm/bf16_gemm.h"
#include "csrc/core/base/dtype.h"
#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/runtime/isa.h"

namespace tokamax {

// Granularity of the blocking knobs: block_m is a multiple of kGemmMr and block_n of kGemmNr
// on every tier. A tier's own tile (GemmKernels::mr x nr) may be larger: avx512 uses 12 x 32,
// and partial tiles are zero-padded.
constexpr int64_t kGemmMr = 6;
constexpr int64_t kGemmNr = 16;

// Packing B pays once a task reuses each of its elements for about this many rows; fewer rows
// read B in place (GemmBlocking::pack_b false). Measured with ragged_dot: avx2 64-row groups
// 1.2x faster in place, 1024-row groups 1.1x faster packed, avx512 in place 1.1x faster; fp32
// fused_experts at 4-token decode 1.16 -> 0.38 ms (amd_zen4_avx512bf16).
constexpr int64_t kGemmPackBMinRows = 96;

// A region of at most this many rows whose B is read in place (GemmBlocking::pack_b false) and
// has its columns contiguous along the depth (a transposed view: an nn.Linear weight, the
// experts of a Hugging Face MoE) takes the column-dot form: each result one dot product of an A
// row with a B column, B read once in memory order with nothing packed (bf16 x bf16 on the bf16
// engine's column dots where the tier has them). Packing such a B for a decode-sized product
// cost twice the time of reading it (gated_linear_unit on nn.Linear views, K=2048, N=5632,
// amd_zen5_avx512bf16, 2 threads: bf16 M=1/4/8 2.7 -> 0.8/1.1/1.8 ms, fp32 5.2 -> 1.7/2.5/4.6).
constexpr int64_t kGemmDotMaxRows = 8;
// Blocks of at most this many rows on an fp32 B read in place along its rows take
// GemmKernels::wide_f32 (the same bits as the micro-kernel): fp32 decode reads B in runs of up to
// 1 KiB a row instead of 128 bytes (amd_zen5_avx512bf16, 2 threads, one process, min of 10-15:
// fused_experts E=60 top-4 H=2048 I=1408 at 1/4/16 tokens 4.29/14.7/47.6 -> 3.53/12.4/39.7 ms,
// gated_linear_unit K=2048 N=5632 M=1/2 2.79/2.87 -> 2.03/2.25 ms, M=4 unchanged). 16-bit B
// measured 2-16% slower on fused_experts that way and keeps the micro-kernel.
constexpr int64_t kGemmWideRows = 4;

// Slice depth and column block of a product of `rows` rows (< kGemmPackBMinRows) that reads
// B in place: such a product streams B from memory, so the blocking keeps the rows of B being
// walked in flight together. The ops' heuristics take it for their in-place products.
struct StreamingBlocking {
  int64_t block_k;
  int64_t block_n;  // columns of C per block (a gated product walks twice as many of B)
};
StreamingBlocking InPlaceBlocking(int64_t rows, DType dtype, const CpuInfo& cpu);
// Whether such a product runs on the fp32 micro-kernels, B widened as it is read: every dtype but
// bf16 on a CPU with a bf16 engine, whose regions from one 16-row tile pack B for the engine.
inline bool InPlaceProductWidens(int64_t rows, DType dtype, const CpuInfo& cpu) {
  return dtype != DType::kBFloat16 || !cpu.avx512bf16 || rows < kBf16TileRows;
}

// A rows x cols matrix; element (i, j) is at data + (i * row_stride + j * col_stride) elements.
struct ConstMatrix {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

struct MutableMatrix {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

// The activation a GemmEpilogue applies (fp32, after scale and bias).
enum class Activation {
  kNone,
  kRelu,      // max(x, 0)
  kSilu,      // x · sigmoid(x)
  kGeluTanh,  // 0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))
  kGeluErf,   // 0.5 x (1 + erf(x / sqrt(2))) (exact GELU)
  kSigmoid,   // 1 / (1 + exp(-x))
};

// The gated product (a gated linear unit) a GemmEpilogue turns GemmRegion into: B is the gate's
// weights and `up` a second K x N matrix multiplied by the same packed A, and
//   C[row(i)][j] = activation(scale · (A·B)[i][j] + bias[j]) · (scale · (A·up)[i][j] + up_bias[j])
// with the reductions and the scatter of GemmEpilogue applied to that result. The two products
// never exist as a [M, 2N] matrix: B's and up's columns are packed interleaved, GemmKernels::nr
// of each at a time, so one micro-kernel pass yields both, and store_c combines each pair of
// column groups. Optionally the pre-activations x_gate = scale·(A·B) + bias and x_up (what a
// backward needs) are written too, at the rows and columns of C (row_map applies), in their
// matrices' dtypes. Each result's sums are those of the plain product: the bits of (A·B)[i][j]
// and (A·up)[i][j] are GemmRegion's on B and on up alone. The activation runs vectorized with
// the vector layer's exp (a few ulp from std::exp), so a gated kSilu differs from a plain one in
// the last bits.
struct GemmGate {
  ConstMatrix up;                    // K x N, any strides, B's dtype (float64: all of A, B, up, C)
  const float* up_bias = nullptr;    // [C.cols], fp32; null: none
  MutableMatrix gate_out;            // M x N pre-activations of the gate; data null: not written
  MutableMatrix up_out;              // M x N pre-activations of up; data null: not written
};

// What GemmRegion does to each fp32 result r[i][j] = (A·B)[i][j] on its way to C, in this order:
//   x = scale · r + bias[j];  x = activation(x);  per-row reductions of x;  C[row(i)][j] = x in C's
//   dtype (the down-cast), row(i) = row_map[i] (a scatter), or i without a map.
// A default GemmEpilogue stores the products as they are: every GemmRegion result goes through
// this one store (GemmKernels::store_c), whose steps left at their defaults cost one branch a row.
// The reductions keep an online logsumexp per result row i over the columns GemmRegion writes:
// with row_max[i] = -inf and row_sum[i] = 0 before the first call, after the calls that cover a
// row's columns row_max[i] = max_j x and row_sum[i] = sum_j exp(x - row_max[i]) (the running max
// and sum of an online softmax or a fused cross-entropy). Column blocks combine in column order,
// so calls that split a row's columns between threads need their own arrays. The epilogue runs
// once per block of results in the tier's store, never per tile.
struct GemmEpilogue {
  float scale = 1.0f;
  const float* bias = nullptr;      // [C.cols], fp32; null: none
  Activation activation = Activation::kNone;
  const int64_t* row_map = nullptr;  // [A.rows] distinct rows of C; null: row i
  float* row_max = nullptr;          // [A.rows] with row_sum (both or neither); null: no reductions
  float* row_sum = nullptr;
  const GemmGate* gate = nullptr;    // non-null: the gated product (GemmGate); bias is the gate's
  // true: the products add to C instead of replacing it (C += A·B; not with gate): each result
  // starts as r[i][j] = C[row(i)][j] + (A·B)[i][j], C read in fp32 (double on the float64 path)
  // before the steps above. With the other steps at their defaults C becomes C + P rounded once
  // into C's dtype, P the fp32 product GemmRegion writes without it (bitwise).
  bool accumulate = false;
};

// How GemmRegion reads A: result row i is row a_row_map[i] of the `a` it is given (a gather),
// or row i without a map; A.rows is then the number of result rows, and a_row_map[i] < the rows
// a.data holds. Rows may repeat (one token sent to several experts). The packers read the rows
// through the map, so a gathered product costs no materialised copy of the gathered A and gives
// the same bits as the product on that copy.
struct GemmPrologue {
  const int64_t* a_row_map = nullptr;  // [A.rows]; null: row i
};

struct GemmBlocking {
  int64_t block_m = 96;   // rows of A packed at once (multiple of kGemmMr)
  int64_t block_k = 256;  // depth of one packed slice of K
  int64_t block_n = 512;  // columns of B packed at once (multiple of kGemmNr)
  // false: read B in place, along its rows when they are contiguous, as columns (the column-dot
  // form, kGemmDotMaxRows) when its columns are and the region is that short; else packed.
  bool pack_b = true;
  // A gated product (GemmGate) packs 2 * RoundUp(block_n, GemmKernels::nr) columns of B and up
  // per block_n columns of C.
};

// The per-ISA routines the driver is built from. Panels are fp32, zero-padded to full tiles.
struct GemmKernels {
  int64_t mr;  // rows of the micro-kernel tile
  int64_t nr;  // columns of the micro-kernel tile
  // dst[p][i] for p < depth, i < mr: A(row(row0 + r*mr + i), k0 + p) per mr-row panel r, with
  // row(x) = row_map[x] (GemmPrologue's gather), or x for a null map.
  void (*pack_a)(const ConstMatrix& a, int64_t row0, int64_t rows, int64_t k0, int64_t depth,
                 const int64_t* row_map, float* dst);
  // dst panel q (q*depth*nr floats): B(k0 + p, col0 + q*nr + j) at [p][j].
  void (*pack_b)(const ConstMatrix& b, int64_t k0, int64_t depth, int64_t col0, int64_t cols,
                 float* dst);
  // c[i][j] (+)= sum_p a[p*lda + i] * b[p*ldb + j] for i < rows (1 <= rows <= mr), j < nr;
  // b's type varies. lda is mr for a packed panel; a larger lda reads an fp32 matrix whose mr
  // rows at each depth step are adjacent (a transposed tile) in place, without packing it. A
  // short tile (a region's last rows) runs a tier's narrower kernel where it has one (avx512:
  // 4 and 8 rows), which may also write c's rows up to its own height (products of A's
  // padding); each element's sum is accumulated in the same order whatever the height, so
  // every row's bits are those of the full tile.
  void (*micro_f32)(int64_t rows, int64_t depth, const float* a, int64_t lda, const float* b, int64_t ldb,
                    float* c, int64_t ldc, bool accumulate);
  void (*micro_bf16)(int64_t rows, int64_t depth, const float* a, int64_t lda, const uint16_t* b, int64_t ldb,
                     float* c, int64_t ldc, bool accumulate);
  void (*micro_f16)(int64_t rows, int64_t depth, const float* a, int64_t lda, const uint16_t* b, int64_t ldb,
                    float* c, int64_t ldc, bool accumulate);
  // C(row(row0 + i), col0 + j) = x in C's dtype for x = acc[i * ld + j] through `epilogue`
  // (GemmEpilogue: a default one stores acc as it is); acc is rewritten in place. With
  // epilogue.gate, acc holds nr-wide column groups of the gate and up alternately: column
  // col0 + g * nr + t of C combines acc[i * ld + 2 * g * nr + t] and acc[i * ld + (2 * g + 1) * nr + t].
  void (*store_c)(float* acc, int64_t ld, int64_t rows, int64_t cols, const MutableMatrix& c, int64_t row0,
                  int64_t col0, const GemmEpilogue& epilogue);
  // The column-dot form: c[i * ldc + j] = sum_p a[i * lda + p] · B(p, j) for i < rows (1 <= rows
  // <= kGemmDotMaxRows), j < cols, B's column j at b + j * ldb and contiguous along p, a fp32
  // rows. Lane l of a vector sums the steps p = l (mod the tier's lanes) in order, then one fixed
  // reduction: each result's bits depend on the depth and the tier only (not on block_k).
  void (*dot_f32)(int64_t rows, int64_t cols, int64_t depth, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float* c, int64_t ldc);
  void (*dot_bf16)(int64_t rows, int64_t cols, int64_t depth, const float* a, int64_t lda, const uint16_t* b,
                   int64_t ldb, float* c, int64_t ldc);
  void (*dot_f16)(int64_t rows, int64_t cols, int64_t depth, const float* a, int64_t lda, const uint16_t* b,
                  int64_t ldb, float* c, int64_t ldc);
  // A few-row tile of an fp32 B read in place, wide: c(i, j) (+)= sum_p a[p * lda + i] · b[p * ldb
  // + j] for i < rows (<= kGemmWideRows), j < cols (whole nr-wide panels), the result of column j
  // at c + (j / nr) * group_stride + j % nr + i * ldc (a gated block interleaves its groups). Each
  // element sums in micro_f32's order (its bits), but a B row is read as one run of up to 16
  // vectors per step instead of one panel's two: null on the scalar tier.
  void (*wide_f32)(int64_t rows, int64_t cols, int64_t depth, const float* a, int64_t lda, const float* b,
                   int64_t ldb, float* c, int64_t ldc, int64_t group_stride, bool accumulate);
  // dst[i * ld + p] = A(row(row0 + i), p) in fp32 for i < rows, p < A.cols (ld >= A.cols), row(x)
  // = row_map[x] (GemmPrologue's gather) or x: the column-dot form's A.
  void (*widen_rows)(const ConstMatrix& a, int64_t row0, int64_t rows, const int64_t* row_map, float* dst,
                     int64_t ld);
  // The avx512bf16 and amx tiers: bf16 x bf16 products run on the tier's bf16 product engine
  // (bf16_gemm.h) instead of the fp32 micro-kernels; the tables are otherwise the avx512 tier's.
  Bf16Products bf16;
};

// How the avx512 micro-kernel hands each A value to its row's two FMAs; the bits are the same
// either way (the other tiers have one form). kEmbedded folds the broadcast into each FMA's
// memory operand ({1to16}): 24 fused uops but 26 loads per depth step. kRegister loads each row's
// value once (vbroadcastss) into a register both FMAs read: 14 loads, 38 uops. Intel (Xeon model
// 167, Sapphire Rapids class) runs kRegister faster: 12 x 32 tile with L1-resident panels 163 ->
// 174 GFLOP/s a core (peak 207), ragged_dot fp32 64 groups with B read in place 25 -> 20 ms;
// Zen 4 ran kEmbedded faster (103-109 against 93-95 GFLOP/s a core in L1: its front end limits
// the longer form).
enum class FmaBroadcastForm { kEmbedded, kRegister };

// kRegister on Intel CPUs and AMD Zen 5 and later (full-width 512-bit FMAs), kEmbedded elsewhere.
FmaBroadcastForm PreferredFmaBroadcastForm(const CpuInfo& cpu);

// The tier's kernels in the running CPU's preferred form, or in `form`.
const GemmKernels& GetGemmKernels(Isa isa);
const GemmKernels& GetGemmKernels(Isa isa, FmaBroadcastForm form);

// Writes C[m0:m1, n0:n1] = A[m0:m1, :] · B[:, n0:n1] (A is M x K, B is K x N, C is M x N);
// K == 0 writes zeros. Every result goes through `epilogue` (GemmEpilogue; the default stores
// the products as they are) on its way to C, and A's rows are read through `prologue`'s gather
// (GemmPrologue). With epilogue.gate the product is gated (GemmGate): B and gate->up share
// A's packed panels, and C gets their combination. With a `bf16` engine and bf16 A and B
// (unless B would be read in place for fewer rows than one 16-row tile), A and B are copied as
// bf16 (B in VNNI panels) and multiplied by the engine, in the same block_k slices. Runs on the
// calling thread with thread-local scratch. float64 operands (all three) take a plain
// double-precision loop instead of the packed fp32 path (the epilogue then in double too).
void GemmRegion(const GemmKernels& kernels, const ConstMatrix& a, const ConstMatrix& b,
                const MutableMatrix& c, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                const GemmBlocking& blocking, const GemmEpilogue& epilogue = {},
                const GemmPrologue& prologue = {});

// The activation of one value, in float or (the float64 path) double.
template <typename T>
inline T Activate(Activation activation, T x) {
  switch (activation) {
    case Activation::kNone: return x;
    case Activation::kRelu: return x > T(0) ? x : T(0);
    case Activation::kSilu: return x / (T(1) + std::exp(-x));
    case Activation::kGeluTanh:
      return T(0.5) * x * (T(1) + std::tanh(T(0.7978845608028654) * (x + T(0.044715) * x * x * x)));
    case Activation::kGeluErf: return T(0.5) * x * (T(1) + std::erf(x * T(0.7071067811865476)));
    case Activation::kSigmoid: return T(1) / (T(1) + std::exp(-x));
  }
  return x;
}

// The same product through plain scalar loops in float64; the oracle of the C++ tests.
void ReferenceGemm(const ConstMatrix& a, const ConstMatrix& b, const MutableMatrix& c);

}  // namespace tokamax
