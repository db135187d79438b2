// linear_softmax_cross_entropy_loss: the cross-entropy of softmax(x · W) against integer labels,
// x[B, H], W[H, V], without the [B, V] logits ever existing. Logits are made one tile at a time
// on the GEMM core, transposed (tile[v][r]: vocabulary rows, batch columns) so every per-row
// reduction runs down a column and vectorizes across batch rows.
//
// Per batch row r with label y (z = logits, capped z = cap·tanh(z/cap) when logits_soft_cap > 0):
//   lse = logsumexp_v z_v,  loss = (1-ε)(lse - z_y) + ε(lse - mean_v z_v) + z_loss_weight·lse²,
// 0 for a row whose label is ignore_index (ε = label_smoothing, F.cross_entropy's smoothing).
// sum/mean reduce the rows in row order (mean over the non-ignored rows; 0 when there are none).
//
// Forward: tasks of row_block rows walk every vocab tile with an online logsumexp; each output
// is written by one task, in an order fixed by the config. Backward: vocab tiles one after the
// other; per tile, (A) tasks of row_block rows recompute the tile, turn it into dlogits from the
// saved lse (softmax, minus the smoothed one-hot, times the row's upstream gradient) in a
// [vocab_block, B] strip, and add dlogits · W_tileᵀ into dx in tile order; (B) tasks of H rows
// write dW[:, tile] = xᵀ · dlogits (the whole batch as the GEMM's depth). Every dx and dW element
// is accumulated in an order fixed by the config and the tier: bitwise the same at any thread count.
//
// Forward with the gradient folded in (sum/mean, params.dx or params.dw set): three products
// instead of the forward's one and the backward's three. Row blocks of FoldRows() rows, one after
// the other; per block, in parallel over vocab tiles or H chunks: the block's logits over the
// whole vocabulary ([V, rows] fp32, transposed as above; at most kFoldBlockBytes), the lse (the
// same column loops in the same tile order as the plain forward: loss and lse bitwise the plain
// forward's), dlogits in place for an upstream gradient of 1, dx[block] = dlogits·Wᵀ (all of V
// deep) and dW += xᵀ[block]·dlogits (the GEMM's accumulate mode; block order). The caller scales
// dx and dW by the loss's actual upstream gradient (LinearCrossEntropyScale), which is linear in
// every option.
#pragma once

#include <cstdint>
#include <vector>

#include "csrc/core/base/config_fields.h"
#include "csrc/core/base/dtype.h"
#include "csrc/core/base/status.h"
#include "csrc/core/base/strided_view.h"
#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/runtime/isa.h"

namespace tokamax {

#define TOKAMAX_LINEAR_SOFTMAX_CROSS_ENTROPY_LOSS_CONFIG_FIELDS(X)                                        \
  X(row_block, 256, 16, 8192, 16, "batch rows per task (the columns of a transposed logits tile)")      \
  X(vocab_block, 512, 16, 16384, 16, "vocabulary entries per logits tile (the backward's dlogits strip)") \
  X(block_k, 256, 16, 4096, 16, "depth of the GEMM's packed K slices (the order of each logit's sum)")
#define TOKAMAX_LINEAR_SOFTMAX_CROSS_ENTROPY_LOSS_PRODUCTS(X) X(kForward, "forward") X(kBackward, "backward")

struct LinearCrossEntropyConfig {
  TOKAMAX_CONFIG_BODY(LinearCrossEntropyConfig, "linear_softmax_cross_entropy_loss",
                      TOKAMAX_LINEAR_SOFTMAX_CROSS_ENTROPY_LOSS_CONFIG_FIELDS,
                      TOKAMAX_LINEAR_SOFTMAX_CROSS_ENTROPY_LOSS_PRODUCTS)
};
using LinearCrossEntropyProduct = LinearCrossEntropyConfig::Product;

struct LinearCrossEntropyShape {
  int64_t batch = 0;   // B
  int64_t hidden = 0;  // H
  int64_t vocab = 0;   // V
};

enum class LossReduction : int { kSum = 0, kMean = 1, kNone = 2 };

// x [B, H] and w [H, V] of one dtype, any strides; labels int64 [B] (`labels_stride` apart).
// Per-row results (loss rows, lse, dloss for kNone) are contiguous in the accumulation type:
// float, or double for float64 x.
struct LinearCrossEntropyParams {
  StridedView<2> x;
  StridedView<2> w;
  const int64_t* labels = nullptr;
  int64_t labels_stride = 1;
  LossReduction reduction = LossReduction::kSum;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  double z_loss_weight = 0.0;
  double logits_soft_cap = 0.0;  // 0: no cap
  // Forward outputs: loss (1 value for sum/mean, B for none) and lse [B].
  void* loss = nullptr;
  void* lse = nullptr;  // the forward writes it; the backward reads it
  // Backward: dloss (1 value or B, as loss) and dlse [B] in (either null: zero); dx [B, H] in
  // x's dtype and dw [H, V] in w's dtype (any strides; either null: not computed) out.
  // Forward (sum/mean): dx and dw, either or both set, in the accumulation type (any strides):
  // the gradients for dloss = 1 are written into them too (the fold, see above).
  const void* dloss = nullptr;
  const void* dlse = nullptr;
  MutableStridedView<2> dx;
  MutableStridedView<2> dw;
};

// Checks every label (ignore_index or in [0, V)) before any compute.
// With params.dx or params.dw (the fold), `gradient_config` (the backward's; null: `config`) tiles
// the gradient products: its vocab_block the dlogits and dW tasks, its block_k the dx and dW sums.
// The row blocks and the logits follow `config`.
Status LinearCrossEntropy(const LinearCrossEntropyParams& params, const LinearCrossEntropyConfig& config,
                          const LinearCrossEntropyConfig* gradient_config = nullptr);
Status LinearCrossEntropyBackward(const LinearCrossEntropyParams& params, const LinearCrossEntropyConfig& config);

// dst[i] = g · src[i] in dst_dtype for i < count (parallel; in place when dst is src): the
// folded gradients times the loss's upstream gradient. src is float (double with g for float64).
void LinearCrossEntropyScale(const void* src, DType src_dtype, double g, void* dst, DType dst_dtype, int64_t count);

// Rows per block of the folded forward: row_block, fewer where the [V, rows] fp32 logits block
// would pass kFoldBlockBytes (at least 16).
constexpr int64_t kFoldBlockBytes = int64_t{128} << 20;
int64_t LinearCrossEntropyFoldRows(const LinearCrossEntropyConfig& config, int64_t vocab);

// Whether the autograd forward folds the gradient in for x of `dtype` on tier `isa` (sum/mean, a
// gradient needed): always for fp32/float64; for bf16/fp16 everywhere but the amx tier, whose
// tile products are fast enough that the fold's three products ran no faster than the unfolded
// four there (docs/benchmarks.md, LCE fold), while on avx512bf16 (vdpbf16ps at ~2x the fp32 FMA
// rate; measured x0.78-0.80 of the time on Zen 4) and on tiers without a bf16 engine a quarter
// fewer flops is about a quarter less time. The price: fp32 dx and dW held to the backward.
bool LinearCrossEntropyFolds(DType dtype, Isa isa);

LinearCrossEntropyConfig LinearCrossEntropyHeuristicConfig(const LinearCrossEntropyShape& call, DType dtype,
                                                           const CpuInfo& cpu, LinearCrossEntropyProduct product);
std::vector<LinearCrossEntropyConfig> LinearCrossEntropyConfigSpace(const LinearCrossEntropyShape& call, DType dtype,
                                                                    const CpuInfo& cpu,
                                                                    LinearCrossEntropyProduct product);

// The column loops of one ISA tier (linear_softmax_cross_entropy_loss_kernels_tiered.cc) on an
// fp32 tile z[v][c], v < rows, c < cols (a multiple of 16, ld floats per row).
struct LinearCrossEntropyKernels {
  // The online logsumexp over one more tile: max[c] and sum[c] (start: -inf and 0) become the
  // running max and sum of exp(z - max) over every tile so far; zsum[c] += sum_v z (if not null).
  void (*forward_tile)(const float* z, int64_t rows, int64_t ld, int64_t cols, float* max, float* sum, float* zsum);
  // z (capped logits) becomes dlogits: d = a·exp(z - lse) - b - (v == label_row ? c1 : 0),
  // times (1 - z²·cap_inv_sq) (the soft cap's derivative; 0 for none), stored at out[v][c]
  // (out_ld apart) in out_dtype (fp32 or bf16).
  void (*backward_tile)(const float* z, int64_t rows, int64_t ld, int64_t cols, const float* lse, const float* a,
                        const float* b, const float* label_row, const float* c1, float cap_inv_sq, void* out,
                        DType out_dtype, int64_t out_ld);
};

const LinearCrossEntropyKernels& GetLinearCrossEntropyKernels(Isa isa);

}  // namespace tokamax
