// layer_norm: y = (h - mean(h)) * rstd * (scale + scale_offset) + offset over the last axis of
// x, rstd = 1 / sqrt(var(h) + epsilon), h = x (+ residual when given, the fused pre-norm add);
// rms_norm is subtract_mean = false (mean taken as 0). Statistics and arithmetic in fp32
// (float64 for float64 x); outputs in x's dtype. Each row is computed by one task in an order
// that depends on the row's length and the ISA tier only: a row's bits do not depend on how
// many rows there are or how they are split (batch invariance). The backward's dscale/doffset
// are per-block partial sums (block_rows rows each, fixed by the config) added in block order.
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

#define TOKAMAX_LAYER_NORM_CONFIG_FIELDS(X) \
  X(block_rows, 64, 1, 65536, 1, "rows per parallel task; the backward's dscale/doffset partial-sum block")
#define TOKAMAX_LAYER_NORM_PRODUCTS(X) X(kForward, "forward") X(kBackward, "backward")

struct LayerNormConfig {
  TOKAMAX_CONFIG_BODY(LayerNormConfig, "layer_norm", TOKAMAX_LAYER_NORM_CONFIG_FIELDS, TOKAMAX_LAYER_NORM_PRODUCTS)
};
using LayerNormProduct = LayerNormConfig::Product;

struct LayerNormShape {
  int64_t rows = 0;  // the product of the leading dims
  int64_t cols = 0;  // the normalised axis
};

// The most dims x may have (leading dims + the normalised one); the adapter flattens more.
constexpr int kLayerNormMaxRank = 8;

// A tensor of x's shape: its rows are the leading `rank - 1` dims (any strides, 0 included),
// its last dim is contiguous (stride 1).
using LayerNormRows = StridedView<kLayerNormMaxRank>;

// The element offset of row `row` (row-major over the leading dims) of a tensor of `rank` dims.
int64_t LayerNormRowOffset(const LayerNormRows& t, int rank, int64_t row);

// Forward: reads x (+ residual), writes y (+ h) contiguous [rows, cols] in x's dtype and mean,
// rstd contiguous [rows] in fp32 (float64 for float64 x). Backward: reads `x` as the normalised
// input (h when a residual was added), dy, dh (optional), mean and rstd; writes dx (and
// dresidual, a second copy, when not null) contiguous in x's dtype, and dscale / doffset [cols]
// in scale's / offset's dtype when not null.
struct LayerNormParams {
  int rank = 2;
  int64_t rows = 0, cols = 0;
  LayerNormRows x, residual, dy, dh;  // null data: absent
  StridedView<1> scale, offset;       // [cols], fp32 or x's dtype; null: 1 and 0
  void* y = nullptr;                  // forward: y; backward: dx
  void* h = nullptr;                  // forward: h (with a residual); backward: dresidual (optional)
  void* mean = nullptr;
  void* rstd = nullptr;
  void* dscale = nullptr;
  void* doffset = nullptr;
  double epsilon = 1e-6;
  double scale_offset = 0.0;  // the scale used is scale + scale_offset (Gemma's 1 + w)
  bool subtract_mean = true;
};

Status LayerNorm(const LayerNormParams& params, const LayerNormConfig& config);
Status LayerNormBackward(const LayerNormParams& params, const LayerNormConfig& config);

LayerNormConfig LayerNormHeuristicConfig(const LayerNormShape& call, DType dtype, const CpuInfo& cpu,
                                         LayerNormProduct product);
std::vector<LayerNormConfig> LayerNormConfigSpace(const LayerNormShape& call, DType dtype, const CpuInfo& cpu,
                                                  LayerNormProduct product);

// The next row's inputs (forward: x and residual; backward: x, dy and dh), each null where absent.
struct LayerNormNextRow {
  const void* inputs[3] = {nullptr, nullptr, nullptr};
};

// The per-row loops of one ISA tier (layer_norm_kernels_tiered.cc), for fp32/bf16/fp16 rows.
// w and b are the row's fp32 scale (scale + scale_offset) and offset, null for 1 and 0.
struct LayerNormKernels {
  // h = x + residual (when residual is not null: stored to h in `dtype`, and the stored h is
  // what is normalised), then y; *mean, *rstd get the row's statistics (mean 0 when
  // !subtract_mean).
  // stream_y: y written with non-temporal stores where aligned (outputs too large for the
  // caches: no read of y's lines before they are written); stream_fence() then ends the task.
  // next: the next row's inputs, asked for into L2 during this row's last pass (a long row's
  // passes over L1 leave the hardware prefetchers nothing to follow).
  void (*forward_row)(DType dtype, const void* x, const void* residual, void* h, void* y, bool stream_y, int64_t cols,
                      const float* w, const float* b, float epsilon, bool subtract_mean, float* mean, float* rstd,
                      const LayerNormNextRow& next);
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dh, g = dy * w, xhat = (x - mean) * rstd
  // (mean(g) dropped when !subtract_mean); stored to dx and, when not null, dresidual. Adds
  // dy * xhat to dscale_acc and dy to doffset_acc (fp32, either may be null).
  // stream_dx: dx and dresidual as y with stream_y.
  void (*backward_row)(DType dtype, const void* x, const void* dy, const void* dh, void* dx, void* dresidual,
                       bool stream_dx, int64_t cols, const float* w, float mean, float rstd, bool subtract_mean, float* dscale_acc,
                       float* doffset_acc, const LayerNormNextRow& next);
  void (*stream_fence)();
};

const LayerNormKernels& GetLayerNormKernels(Isa isa);

// float64 oracles of the same math for the C++ tests: y[rows*cols], mean[rows], rstd[rows] from
// contiguous double rows (x already including any residual), and the backward.
void LayerNormReference(const std::vector<double>& x, int64_t rows, int64_t cols, const std::vector<double>& w,
                        const std::vector<double>& b, double epsilon, bool subtract_mean, std::vector<double>* y,
                        std::vector<double>* mean, std::vector<double>* rstd);

}  // namespace tokamax
