// The ragged_dot CPU kernel: one GEMM per group, split into (group, row block, column block)
// tasks that threads pull from a shared counter, so many small groups keep every core busy.
#include "csrc/ops/ragged_dot/ragged_dot.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "csrc/core/gemm/gemm.h"
#include "csrc/core/runtime/isa.h"
#include "csrc/core/runtime/parallel.h"

namespace tokamax {
namespace {

// One group's product as a GEMM C = A · B over strided views.
struct GroupGemm {
  ConstMatrix a;
  ConstMatrix b;
  MutableMatrix c;
};

struct Task {
  int64_t group;
  int64_t m0, m1, n0, n1;
};

void* Advance(void* base, DType dtype, int64_t elements) {
  return static_cast<char*>(base) + elements * DTypeSize(dtype);
}

GroupGemm MakeGroupGemm(const RaggedDotParams& p, int64_t group, int64_t row_start, int64_t rows) {
  const StridedView<3>& lhs = p.lhs;
  const StridedView<3>& rhs = p.rhs;
  GroupGemm gemm;
  switch (p.form) {
    case RaggedDotForm::kDefault:
    case RaggedDotForm::kTransRhs: {
      const bool trans = p.form == RaggedDotForm::kTransRhs;
      const int64_t k = lhs.sizes[1];
      const int64_t n = trans ? rhs.sizes[1] : rhs.sizes[2];
      gemm.a = {lhs.At(row_start, 0, 0), lhs.dtype, rows, k,
                lhs.strides[0], lhs.strides[1]};
      // rhs[g] as a K x N matrix: [K, N] directly, or [N, K] read transposed.
      const void* rhs_g = rhs.At(group, 0, 0);
      gemm.b = {rhs_g, rhs.dtype, k, n, trans ? rhs.strides[2] : rhs.strides[1],
                trans ? rhs.strides[1] : rhs.strides[2]};
      gemm.c = {Advance(p.out, p.out_dtype, row_start * p.out_strides[0]), p.out_dtype, rows, n,
                p.out_strides[0], p.out_strides[1]};
      break;
    }
    case RaggedDotForm::kRaggedContracting: {
      // out[g] (K x N) = lhs_rowsᵀ (K x rows) · rhs_rows (rows x N).
      const int64_t k = lhs.sizes[1];
      const int64_t n = rhs.sizes[1];
      gemm.a = {lhs.At(row_start, 0, 0), lhs.dtype, k, rows,
                lhs.strides[1], lhs.strides[0]};
      gemm.b = {rhs.At(row_start, 0, 0), rhs.dtype, rows, n,
                rhs.strides[0], rhs.strides[1]};
      gemm.c = {Advance(p.out, p.out_dtype, group * p.out_strides[0]), p.out_dtype, k, n,
                p.out_strides[1], p.out_strides[2]};
      break;
    }
  }
  return gemm;
}

void ZeroRows(const RaggedDotParams& p, int64_t row_begin, int64_t row_end, int64_t cols) {
  DispatchDType(p.out_dtype, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t i = row_begin; i < row_end; ++i) {
      T* row = static_cast<T*>(p.out) + i * p.out_strides[0];
      for (int64_t j = 0; j < cols; ++j) StoreFromFloat(row + j * p.out_strides[1], 0.0f);
    }
    return 0;
  });
}

}  // namespace

Status RaggedDot(const RaggedDotParams& params, const RaggedDotConfig& config) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  const int64_t m = params.lhs.sizes[0];
  status = CheckRaggedDotGroupSizes(params.group_sizes, params.num_groups, m);
  if (!status.ok()) return status;
  Isa isa;
  status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  const GemmKernels& kernels = GetGemmKernels(isa);

  std::vector<GroupGemm> gemms;
  std::vector<Task> tasks;
  gemms.reserve(params.num_groups);
  int64_t row_start = 0;
  for (int64_t g = 0; g < params.num_groups; ++g) {
    const int64_t rows = params.group_sizes[g];
    const GroupGemm gemm = MakeGroupGemm(params, g, row_start, rows);
    gemms.push_back(gemm);
    row_start += rows;
    for (int64_t m0 = 0; m0 < gemm.c.rows; m0 += config.task_m) {
      for (int64_t n0 = 0; n0 < gemm.c.cols; n0 += config.block_n) {
        tasks.push_back({g, m0, std::min(m0 + config.task_m, gemm.c.rows), n0,
                         std::min(n0 + config.block_n, gemm.c.cols)});
      }
    }
  }
  // Rows past the last group are defined to be zero.
  if (params.form != RaggedDotForm::kRaggedContracting) {
    const int64_t cols = params.form == RaggedDotForm::kTransRhs ? params.rhs.sizes[1] : params.rhs.sizes[2];
    ZeroRows(params, row_start, m, cols);
  }

  std::atomic<int64_t> next_task{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  ParallelFor(0, num_tasks, 1, [&](int64_t, int64_t) {
    for (int64_t t = next_task.fetch_add(1); t < num_tasks; t = next_task.fetch_add(1)) {
      const Task& task = tasks[t];
      const GroupGemm& gemm = gemms[task.group];
      GemmBlocking blocking;
      blocking.block_m = config.block_m;
      blocking.block_k = config.block_k;
      blocking.block_n = config.block_n;
      blocking.pack_b = task.m1 - task.m0 >= config.pack_b_min_rows;
      GemmRegion(kernels, gemm.a, gemm.b, gemm.c, task.m0, task.m1, task.n0, task.n1, blocking);
    }
  });
  return Status::Ok();
}

void RaggedDotReference(const RaggedDotParams& params) {
  const int64_t m = params.lhs.sizes[0];
  int64_t row_start = 0;
  for (int64_t g = 0; g < params.num_groups; ++g) {
    const GroupGemm gemm = MakeGroupGemm(params, g, row_start, params.group_sizes[g]);
    ReferenceGemm(gemm.a, gemm.b, gemm.c);
    row_start += params.group_sizes[g];
  }
  if (params.form != RaggedDotForm::kRaggedContracting) {
    const int64_t cols = params.form == RaggedDotForm::kTransRhs ? params.rhs.sizes[1] : params.rhs.sizes[2];
    ZeroRows(params, row_start, m, cols);
  }
}

}  // namespace tokamax
