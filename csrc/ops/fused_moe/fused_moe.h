// fused_moe / fused_experts: a mixture-of-experts feed-forward in one call.
//
//   fused_experts(x[T,H], w1[E,H,2I], w2[E,I,H], topk_weights[T,k], topk_ids[T,k]):
//     out[t] = sum over j < k, ascending, of w[t,j] * y(t, topk_ids[t,j]) in fp32, stored in x's dtype,
//     y(t, e) = (act(x[t]·w1[e][:, :I] + b1[e][:I]) * (x[t]·w1[e][:, I:] + b1[e][I:]))·w2[e] + b2[e].
//   fused_moe(x, w1, w2, gating[T,E], topk, renormalize): the weights and ids are the router's:
//     p = softmax(gating[t]) in fp32, the k largest p (ties to the lowest id), divided by their sum
//     when renormalize.
//
// The kernel works on the (token, slot) pairs sorted by expert (moe_gather's counting sort), in
// tasks over (expert, column block) that take all of a block of up to task_rows of the expert's
// rows, so each weight panel is packed once per call: the gate|up product runs on the GEMM core's
// gated epilogue (GemmGate: one packed pass over the rows, the GLU in the GEMM's store) into
// h [T*k, I], h·w2 into a per-slot fp32 buffer, and a fixed-order per-token sum combines the
// slots. The [T*k, 2I] pre-activations are written only when asked for (a forward whose backward
// will need them); the backward reads them, or recomputes them with the same gated product. Every
// output element is made by one task in an order fixed by the config: bitwise the same at any
// thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "csrc/core/base/config_fields.h"
#include "csrc/core/base/dtype.h"
#include "csrc/core/base/status.h"
#include "csrc/core/base/strided_view.h"
#include "csrc/core/gemm/gemm.h"
#include "csrc/core/runtime/cpu_info.h"
#include "csrc/ops/moe_gather/moe_gather.h"

namespace tokamax {

// One field list for both entries (fused_moe's experts part is fused_experts).
#define TOKAMAX_FUSED_MOE_CONFIG_FIELDS(X)                                                         \
  X(task_rows, 96, 6, 4096, 6, "most of one expert's (token, slot) rows in one task")                         \
  X(block_k, 256, 16, 8192, 16, "depth of one packed slice of K (the sum order of every product)") \
  X(block_n, 512, 16, 8192, 16, "columns of B packed at once; a weight-gradient task's columns")   \
  X(pack_b_min_rows, 96, 0, (int64_t{1} << 30), 1,                                                 \
    "a task with fewer rows reads contiguous weight columns in place instead of packing them")
#define TOKAMAX_FUSED_MOE_PRODUCTS(X) X(kForward, "forward") X(kBackward, "backward")

struct FusedExpertsConfig {
  TOKAMAX_CONFIG_BODY(FusedExpertsConfig, "fused_experts", TOKAMAX_FUSED_MOE_CONFIG_FIELDS,
                      TOKAMAX_FUSED_MOE_PRODUCTS)
};
struct FusedMoeConfig {
  TOKAMAX_CONFIG_BODY(FusedMoeConfig, "fused_moe", TOKAMAX_FUSED_MOE_CONFIG_FIELDS, TOKAMAX_FUSED_MOE_PRODUCTS)
};
using FusedExpertsProduct = FusedExpertsConfig::Product;
using FusedMoeProduct = FusedMoeConfig::Product;

// fused_moe runs the experts kernel with its own config: same fields, same meaning.
FusedExpertsConfig ToExpertsConfig(const FusedMoeConfig& config);

struct FusedExpertsShape {
  int64_t tokens = 0;        // T
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  int64_t experts = 0;       // E
  int64_t topk = 0;          // k
  // w1's and w2's columns are contiguous (not Hugging Face's transposed views): an expert task of
  // few rows reads them in place, which wants other blocking.
  bool weights_in_place = true;
};

struct FusedExpertsParams {
  Activation activation = Activation::kSilu;  // kSilu or kGeluTanh
  StridedView<2> x;             // [T, H]
  StridedView<3> w1;            // [E, H, 2I], x's dtype, any strides (a transposed view is fine)
  StridedView<3> w2;            // [E, I, H], x's dtype
  StridedView<2> w1_bias;       // [E, 2I], x's dtype; null data: none
  StridedView<2> w2_bias;       // [E, H]; null data: none
  StridedView<2> topk_weights;  // [T, k], any float dtype
  IndexMatrix topk_ids;         // [T, k], ids in [0, E) (checked before any write)
  MutableStridedView<2> out;    // forward: [T, H], x's dtype
  // Backward: dout [T, H] in x's dtype; gradients as their inputs' shapes and dtypes.
  StridedView<2> dout;
  MutableStridedView<2> dx;
  MutableStridedView<3> dw1, dw2;
  MutableStridedView<2> dw1_bias, dw2_bias;  // null data: not computed
  MutableStridedView<2> dtopk_weights;       // [T, k], topk_weights' dtype
  // The pre-activations gate|up per (token, slot) pair, [T*k, 2I] contiguous in x's dtype, rows
  // sorted by expert (stable): the forward writes them when non-null, the backward reads them
  // when non-null (and recomputes them otherwise).
  void* residuals = nullptr;
};

// The backward's per-row elementwise pass (fused_moe_kernels_tiered.cc), for one sorted row of n
// elements with routing weight w: d = dout·w2ᵀ (fp32); gate, up, wh, dgate, dup in x's dtype;
// wh = w act(gate) up, dgate = w d up act'(gate), dup = w d act(gate); returns sum d act(gate) up.
// One per tier, dtype and activation (null for float64).
using MoeRowGradsFn = float (*)(const float* d, const void* gate, const void* up, float w, void* wh, void* dgate,
                                void* dup, int64_t n);

Status FusedExperts(const FusedExpertsParams& params, const FusedExpertsConfig& config);
Status FusedExpertsBackward(const FusedExpertsParams& params, const FusedExpertsConfig& config);

// fused_moe's router: weights fp32 [T, k] (descending) and ids int32 [T, k] from gating [T, E].
struct MoeRouterParams {
  StridedView<2> gating;  // [T, E], float
  int64_t k = 0;
  bool renormalize = true;
  float* weights = nullptr;   // [T, k] contiguous
  int32_t* ids = nullptr;     // [T, k] contiguous
  // Backward: dgating[t] from dweights[t] (contiguous fp32 [T, k]) through the renormalisation
  // and the softmax (the selection is piecewise constant).
  const float* dweights = nullptr;
  MutableStridedView<2> dgating;  // gating's dtype
};
Status MoeRouter(const MoeRouterParams& params);
Status MoeRouterBackward(const MoeRouterParams& params);

FusedExpertsConfig FusedExpertsHeuristicConfig(const FusedExpertsShape& call, DType dtype, const CpuInfo& cpu,
                                               FusedExpertsProduct product);
std::vector<FusedExpertsConfig> FusedExpertsConfigSpace(const FusedExpertsShape& call, DType dtype,
                                                        const CpuInfo& cpu, FusedExpertsProduct product);
FusedMoeConfig FusedMoeHeuristicConfig(const FusedExpertsShape& call, DType dtype, const CpuInfo& cpu,
                                       FusedMoeProduct product);
std::vector<FusedMoeConfig> FusedMoeConfigSpace(const FusedExpertsShape& call, DType dtype, const CpuInfo& cpu,
                                                FusedMoeProduct product);

}  // namespace tokamax
