#include "csrc/ops/topk/topk.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "csrc/core/runtime/parallel.h"
#include "csrc/core/vec/tiers.h"

namespace tokamax {

TOKAMAX_DECLARE_IN_TIERS(const TopKKernels& TopKKernelTable();)

// A tier this build lacks gets the scalar table; the avx512 variants add nothing to a compare scan.
const TopKKernels& GetTopKKernels(Isa isa) {
  TOKAMAX_RETURN_BY_VECTOR_WIDTH(isa, TopKKernelTable());
}

namespace {

// The row selection for the scores' dtype, or an error naming the op.
Status SelectFunction(const char* op, DType dtype, SelectRowFn* select) {
  Isa isa;
  Status status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  const TopKKernels& kernels = GetTopKKernels(isa);
  switch (dtype) {
    case DType::kFloat32: *select = kernels.select_f32; return Status::Ok();
    case DType::kBFloat16: *select = kernels.select_bf16; return Status::Ok();
    case DType::kFloat16: *select = kernels.select_f16; return Status::Ok();
    default: break;
  }
  return Status::Error(std::string(op) + ": scores must be float32, bfloat16 or float16, got " + DTypeName(dtype));
}

// What both entry points check first: the row selection for the scores' dtype, and
// 1 <= k <= n (the row length, named n_name in the error).
Status BeginSelect(const char* op, const StridedView<2>& scores, int64_t k, const char* n_name,
                   SelectRowFn* select) {
  Status status = SelectFunction(op, scores.dtype, select);
  if (!status.ok()) return status;
  const int64_t n = scores.sizes[1];
  if (k < 1 || k > n) {
    return Status::Error(std::string(op) + ": k must be in [1, " + n_name + "=" + std::to_string(n) + "], got " +
                         std::to_string(k));
  }
  return Status::Ok();
}

// Rows per task: about 16K scores, so a task outweighs its scheduling; rows are independent,
// so the split never changes a bit.
int64_t RowGrain(int64_t cols) { return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(cols, 1)); }

}  // namespace

Status RouterTopK(const RouterTopKParams& params) {
  const int64_t rows = params.scores.sizes[0], cols = params.scores.sizes[1], k = params.k;
  SelectRowFn select;
  const Status status = BeginSelect("router_topk", params.scores, k, "E", &select);
  if (!status.ok()) return status;
  if (rows == 0) return Status::Ok();
  ParallelFor(0, rows, RowGrain(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* weights = params.weights + r * k;
      int32_t* indices = params.indices + r * k;
      const int64_t good = select(params.scores.At(r, 0), params.scores.strides[1], cols, k, kRouterTopKFloor,
                                  weights, indices);
      if (good == k) continue;
      // Upstream's arg-max passes: every remaining column holds the floor, so the lowest
      // unselected ids come next at the floor's value; a row with nothing good is all NaN.
      const float fill = good == 0 ? std::numeric_limits<float>::quiet_NaN() : kRouterTopKFloor;
      int32_t next = 0;
      for (int64_t j = good; j < k; ++j) {
        while (std::find(indices, indices + good, next) != indices + good) ++next;
        indices[j] = next++;
        weights[j] = fill;
      }
    }
  });
  return Status::Ok();
}

Status TopK(const TopKParams& params) {
  const int64_t rows = params.scores.sizes[0], cols = params.scores.sizes[1], k = params.k;
  SelectRowFn select;
  const Status status = BeginSelect("topk", params.scores, k, "n", &select);
  if (!status.ok()) return status;
  if (rows == 0) return Status::Ok();
  const bool f32_values = params.values != nullptr && params.scores.dtype == DType::kFloat32;
  ParallelFor(0, rows, RowGrain(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(f32_values ? 0 : k);  // the selected values, once per task
    for (int64_t r = begin; r < end; ++r) {
      int64_t length = cols;
      if (params.row_lengths != nullptr) {
        length = std::clamp<int64_t>(params.row_lengths[r * params.row_lengths_stride], 0, cols);
      }
      float* vals = f32_values ? static_cast<float*>(params.values) + r * k : scratch.data();
      int32_t* indices = params.indices + r * k;
      const int64_t found = select(params.scores.At(r, 0), params.scores.strides[1], length, k,
                                   -std::numeric_limits<float>::infinity(), vals, indices);
      std::fill(indices + found, indices + k, -1);
      std::fill(vals + found, vals + k, -std::numeric_limits<float>::infinity());
      if (params.values == nullptr || f32_values) continue;
      // bf16 / fp16 values came from that dtype: narrowing them back is exact.
      DispatchDType(params.scores.dtype, [&](auto tag) {
        using T = decltype(tag);
        if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
          T* out = static_cast<T*>(params.values) + r * k;
          for (int64_t j = 0; j < k; ++j) StoreFromFloat(out + j, vals[j]);
        }
        return 0;
      });
    }
  });
  return Status::Ok();
}

}  // namespace tokamax
