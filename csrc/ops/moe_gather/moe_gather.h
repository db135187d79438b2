// MoE data movement around ragged_dot. moe_permute: the (token, slot) positions of a router's
// expert ids [T, k], sorted by expert (stable), their inverse, and the per-expert counts, i.e. the
// row order and group_sizes a grouped matmul needs. Nothing to tile or tune: no Config.
#pragma once

#include <cstdint>

#include "csrc/core/base/status.h"

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

}  // namespace tokamax
