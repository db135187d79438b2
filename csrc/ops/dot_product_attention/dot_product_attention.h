// dot_product_attention: multi-head attention with grouped kv heads, masks and soft-capping.
//
//   query[B,T,N,H], key[B,S,K,H], value[B,S,K,Hv] -> out[B,T,N,Hv], logsumexp[B,N,T] (fp32)
//   logits = scale · q·kᵀ + bias; logits = cap · tanh(logits / cap) when soft-capped; masked
//   logits are -inf; out = softmax(logits) · v. Query head n reads kv head n / (N / K).
// A query row that sees no key gets out = 0 and logsumexp = -inf, and zero gradients.
// Torch-free: the adapter passes pointers, sizes and element strides (0 for broadcast dims).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "csrc/core/base/config_fields.h"
#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/base/dtype.h"
#include "csrc/core/base/status.h"
#include "csrc/core/base/strided_view.h"

namespace tokamax {

// The adapter's names for the views (csrc/torch builds them); kernels spell StridedView<4>.
using Tensor4View = StridedView<4>;
using MutableTensor4View = MutableStridedView<4>;

// Which (b, n, t, s) pairs are visible. All conditions combine with "and".
struct AttentionMasks {
  static constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max() / 4;
  bool is_causal = false;                 // s <= t (top-left aligned)
  int64_t window_left = kUnbounded;       // t - left <= s
  int64_t window_right = kUnbounded;      // s <= t + right
  const int64_t* q_lengths = nullptr;     // [B]: t < q_lengths[b]
  const int64_t* kv_lengths = nullptr;    // [B]: s < kv_lengths[b]
  const int32_t* q_segment_ids = nullptr;   // [B,T], with kv_segment_ids: equal ids only
  int64_t q_segment_strides[2] = {0, 0};
  const int32_t* kv_segment_ids = nullptr;  // [B,S]
  int64_t kv_segment_strides[2] = {0, 0};
  const uint8_t* mask = nullptr;          // bool [B,N,T,S] (broadcast strides), nonzero = visible
  int64_t mask_strides[4] = {0, 0, 0, 0};
  // The kernels' own: a bool mask every row of which shows one run of keys, held as those runs
  // instead (FoldMaskRuns): row (b, n, t) sees keys [runs[i], runs[i + 1]) at
  // i = 2 * (b * mask_run_strides[0] + n * mask_run_strides[1] + t * mask_run_strides[2]).
  const int64_t* mask_runs = nullptr;
  int64_t mask_run_strides[3] = {0, 0, 0};
};

struct DotProductAttentionParams {
  StridedView<4> q;  // [B,T,N,H]
  StridedView<4> k;  // [B,S,K,H]
  StridedView<4> v;  // [B,S,K,Hv]
  StridedView<4> bias;  // broadcast to [B,N,T,S]; data null when absent
  AttentionMasks masks;
  float scale = 1.0f;
  float logits_soft_cap = 0.0f;  // 0: none
  MutableStridedView<4> out;  // [B,T,N,Hv]
  // [B,N,T] with lse_strides; null when not wanted. float, or double when q is float64 (so
  // float64 gradient checks see an exact logsumexp); the same holds for dlse below.
  void* lse = nullptr;
  int64_t lse_strides[3] = {0, 0, 0};
};

struct DotProductAttentionGradParams {
  DotProductAttentionParams forward;  // its out and lse are the forward's results, read here
  StridedView<4> dout;                // [B,T,N,Hv]
  const void* dlse = nullptr;         // [B,N,T] cotangent of logsumexp; null: zero
  int64_t dlse_strides[3] = {0, 0, 0};
  MutableStridedView<4> dq;           // [B,T,N,H]
  MutableStridedView<4> dk;           // [B,S,K,H]
  MutableStridedView<4> dv;           // [B,S,K,Hv]
  void* dbias = nullptr;              // dense [B,N,T,S] (contiguous), float like lse; null: not wanted
  // dbias is [N,T,S] instead, the batches' gradients summed in batch order (a bias broadcast over
  // the batch): the batches then run one after the other, so no two tasks add to one element.
  bool dbias_sum_batches = false;
};

// The problem as heuristics and cache keys see it.
struct DotProductAttentionShape {
  int64_t batch = 0, q_len = 0, kv_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0, value_dim = 0;
  bool block_sparse = false;  // a causal, window, length or segment mask lets blocks be skipped
};

// Knobs of the CPU kernel, in the order they cross the schema as int[]:
//   X(name, default, min, max, multiple_of, meaning). One struct serves the forward and the
// backward pass. The tile-size limit tying block_q to block_kv is in ValidateCrossFields.
#define TOKAMAX_DOT_PRODUCT_ATTENTION_CONFIG_FIELDS(X)                                               \
  X(block_q, 96, 1, 4096, 1, "query positions per task (times N/K query heads: the tile's rows)")  \
  X(block_kv, 256, 8, 8192, 8, "keys per tile (the granularity of block skipping)")                \
  X(num_splits, 1, 1, 256, 1,                                                                      \
    "forward: the kv sequence of each task is split into this many chunks run in parallel and "   \
    "merged by logsumexp (decode); backward: the query sequence of each kv head is split into "   \
    "this many chunks whose dk/dv partial sums are added in a fixed order")
// The products configured and tuned separately.
#define TOKAMAX_DOT_PRODUCT_ATTENTION_PRODUCTS(X) X(kForward, "forward") X(kBackward, "backward")

struct DotProductAttentionConfig {
  TOKAMAX_CONFIG_BODY(DotProductAttentionConfig, "dot_product_attention", TOKAMAX_DOT_PRODUCT_ATTENTION_CONFIG_FIELDS,
                      TOKAMAX_DOT_PRODUCT_ATTENTION_PRODUCTS)
};
using DotProductAttentionProduct = DotProductAttentionConfig::Product;

// Pure functions of the call's shape, the dtype, the CPU and the product.
DotProductAttentionConfig DotProductAttentionHeuristicConfig(const DotProductAttentionShape& call, DType dtype,
                                                             const CpuInfo& cpu, DotProductAttentionProduct product);
// Candidates for the autotuner: valid configs around the heuristic one, heuristic first.
std::vector<DotProductAttentionConfig> DotProductAttentionConfigSpace(const DotProductAttentionShape& call,
                                                                      DType dtype, const CpuInfo& cpu,
                                                                      DotProductAttentionProduct product);

// Sequence lengths must lie in [0, max]; the adapter checks shapes and dtypes itself.
Status CheckAttentionLengths(const int64_t* lengths, int64_t batch, int64_t max, const char* name);

// The kernels: active ISA tier, installed parallel backend. float64 runs the exact loops below.
Status DotProductAttention(const DotProductAttentionParams& params, const DotProductAttentionConfig& config);
Status DotProductAttentionBackward(const DotProductAttentionGradParams& params,
                                   const DotProductAttentionConfig& config);
// How many tasks the backward runs per batch (kv heads times query splits): with
// dbias_sum_batches, the most that run at once.
int64_t DotProductAttentionBackwardTasksPerBatch(int64_t q_len, int64_t kv_heads,
                                                 const DotProductAttentionConfig& config);

// Plain float64 loops over the same params (any dtype in and out): the oracle of the C++ tests
// and the float64 path of the kernels.
void DotProductAttentionReference(const DotProductAttentionParams& params);
void DotProductAttentionBackwardReference(const DotProductAttentionGradParams& params);

}  // namespace tokamax
