// Exact top-k selection over the rows of a 2-D score matrix, shared by two ops:
//  - RouterTopK (tokamax::router_topk): the k largest scores of each row of scores[T, E] and
//    their expert ids; scores that are NaN or <= kRouterTopKFloor count as kRouterTopKFloor, a
//    row short of good scores is filled with the lowest unselected ids at weight
//    kRouterTopKFloor, and a row with none has NaN weights and ids 0..k-1 (upstream's
//    rowmax_topk).
//  - TopK (tokamax::topk): the k largest eligible scores of each row of scores[b, n], eligible
//    meaning column < clamp(row_lengths[r], 0, n) and score > -inf (NaN never is); indices -1
//    and values -inf pad a row with fewer than k.
// Both: values descending, ties to the lower column, so the result is exact and unique.
#pragma once

#include <cstdint>

#include "csrc/core/base/status.h"
#include "csrc/core/base/strided_view.h"
#include "csrc/core/runtime/isa.h"

namespace tokamax {

// Upstream's clamp value (-3.0e38 as fp32): at or below it, or NaN, a router score is "bad".
inline constexpr float kRouterTopKFloor = -3.0e38f;

struct RouterTopKParams {
  StridedView<2> scores;      // [T, E], float32 / bfloat16 / float16, any strides
  int64_t k = 0;              // in [1, E]
  float* weights = nullptr;   // [T, k], contiguous
  int32_t* indices = nullptr; // [T, k], contiguous
};

struct TopKParams {
  StridedView<2> scores;                 // [b, n], float32 / bfloat16 / float16, any strides
  int64_t k = 0;                         // in [1, n]
  const int32_t* row_lengths = nullptr;  // [b] with element stride row_lengths_stride; null: n
  int64_t row_lengths_stride = 1;
  int32_t* indices = nullptr;            // [b, k], contiguous
  void* values = nullptr;                // [b, k], contiguous, scores' dtype; null: not wanted
};

Status RouterTopK(const RouterTopKParams& params);
Status TopK(const TopKParams& params);

// The per-tier row selection both ops run (topk_kernels_tiered.cc). It scans row[0..n) (element
// stride `stride`) and keeps in vals/idx, sorted descending with ties by lower column, the up to
// k elements > floor; returns how many it kept. One function per storage dtype.
using SelectRowFn = int64_t (*)(const void* row, int64_t stride, int64_t n, int64_t k, float floor, float* vals,
                                int32_t* idx);
struct TopKKernels {
  SelectRowFn select_f32;
  SelectRowFn select_bf16;
  SelectRowFn select_f16;
};
const TopKKernels& GetTopKKernels(Isa isa);

}  // namespace tokamax
