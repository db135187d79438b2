// MoE data movement around ragged_dot. Nothing to tile or tune: no Config.
// moe_permute: the (token, slot) positions of a router's expert ids [T, k], sorted by expert
// (stable), their inverse, and the per-expert counts: the row order and group_sizes of a grouped
// matmul. ragged_gather_reduce: the MoE combine, each token's weighted sum of its gathered rows.
#pragma once

#include <cstdint>

#include "csrc/core/base/status.h"
#include "csrc/core/base/strided_view.h"

namespace tokamax {

// A 2-D matrix of int32 or int64 indices, strides in elements (any layout).
struct IndexMatrix {
  const void* data = nullptr;
  bool is_int64 = true;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 1;

  int64_t At(int64_t r, int64_t c) const {
    const int64_t offset = r * row_stride + c * col_stride;
    return is_int64 ? static_cast<const int64_t*>(data)[offset] : static_cast<const int32_t*>(data)[offset];
  }
};

// A vector of int32 or int64 indices, stride in elements.
struct IndexVector {
  const void* data = nullptr;
  bool is_int64 = true;
  int64_t count = 0;
  int64_t stride = 1;

  int64_t operator[](int64_t i) const {
    return is_int64 ? static_cast<const int64_t*>(data)[i * stride] : static_cast<const int32_t*>(data)[i * stride];
  }
};

// Shapes are the adapter's to check; the kernel checks the id values before writing anything.
struct MoePermuteParams {
  IndexMatrix expert_indices;  // [T, k], ids in [0, num_experts)
  int64_t num_experts = 0;
  int64_t* order = nullptr;        // [T*k]: flattened positions t*k+s, sorted by expert, stable
  int64_t* inverse = nullptr;      // [T*k]: inverse[order[i]] = i
  int32_t* group_sizes = nullptr;  // [num_experts]
};

// A counting sort over fixed chunks of the flattened ids (per-chunk histograms, one prefix sum,
// then each chunk places its ids): the same output at any thread count, and stable.
Status MoePermute(const MoePermuteParams& params);

// ragged_gather_reduce, with N = T * group_size and selected(j) = valid[j] (and the range rule):
//   out[t, :] = sum over j in [t*g, (t+1)*g), ascending, of (selected(j) ? w[j] * x[indices[j], :] : 0)
// in fp32 (float64 for float64 x), stored in x's dtype. The backward:
//   dx[r, :] = sum over selected j with indices[j] == r, ascending, of w[j] * dout[j / g, :]
//   dw[j]    = selected(j) ? sum over h of dout[j / g, h] * x[indices[j], h] : 0
// ragged_gather and ragged_scatter are the same kernels with g = 1, no weights (w = 1, an exact
// copy) and no mask, rows selected by a range rule instead: start <= j < end (kPosition) or
// start <= indices[j] < end (kIndex). Indices of rows not selected are never read. Shapes and
// dtypes are the adapter's to check; the kernels check start/end and the indices of selected
// rows before writing anything.
enum class RowRange { kNone, kPosition, kIndex };

struct RaggedGatherReduceParams {
  const char* op = "ragged_gather_reduce";  // names the op in errors
  StridedView<2> x;              // [R, H]
  IndexVector indices;           // [N]
  StridedView<1> topk_weights;   // [N], any float dtype; null data: every weight is 1
  const uint8_t* valid = nullptr;  // [N] bools; null: every row valid
  int64_t valid_stride = 1;
  RowRange range = RowRange::kNone;
  int64_t start = 0, end = 0;    // the range rule's bounds
  int64_t group_size = 1;
  MutableStridedView<2> out;     // forward: [T, H], x's dtype
  StridedView<2> dout;           // backward: [T, H], x's dtype
  MutableStridedView<2> dx;      // backward: [R, H], x's dtype
  MutableStridedView<1> dtopk_weights;  // backward: [N], topk_weights' dtype; null data: not computed
};

// The row sum both kernels run on unit-stride rows (moe_gather_kernels_tiered.cc, one per tier
// and dtype; null for float64): out[h] = sum over i < count, ascending, of w[i] * rows[i][h] in
// fp32 (0 when count is 0), for h < width, stored in the rows' dtype; `next` (next_count rows,
// the next call's) are prefetched at the same columns.
using GatherSumRowsFn = void (*)(const void* const* rows, const float* w, int64_t count, const void* const* next,
                                 int64_t next_count, void* out, int64_t width);

Status RaggedGatherReduce(const RaggedGatherReduceParams& params);
Status RaggedGatherReduceBackward(const RaggedGatherReduceParams& params);

}  // namespace tokamax
