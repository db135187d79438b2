// The gated_linear_unit CPU kernel: the forward as one gated GEMM, the backward as one
// elementwise pass and two plain GEMMs, each GEMM split into (row block, column block) tasks
// that threads pull from a shared counter.
#include "csrc/ops/gated_linear_unit/gated_linear_unit.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>

#include "csrc/core/base/int_math.h"
#include "csrc/core/runtime/isa.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/core/vec/tiers.h"

namespace tokamax {

TOKAMAX_DECLARE_IN_TIERS(GluRowGradsFn GluRowGrads(DType dtype, Activation activation);)

namespace {

// The tier's row of the elementwise backward; the avx512bf16 and amx tiers run avx512's.
GluRowGradsFn RowGradsOf(Isa isa, DType dtype, Activation activation) {
  TOKAMAX_RETURN_BY_VECTOR_WIDTH(isa, GluRowGrads(dtype, activation));
}

ConstMatrix MatrixOf(const StridedView<2>& v) {
  return {v.data, v.dtype, v.sizes[0], v.sizes[1], v.strides[0], v.strides[1]};
}

// The view's transpose as a matrix.
ConstMatrix TransposedMatrixOf(const StridedView<2>& v) {
  return {v.data, v.dtype, v.sizes[1], v.sizes[0], v.strides[1], v.strides[0]};
}

MutableMatrix MutableMatrixOf(const MutableStridedView<2>& v) {
  return {v.data, v.dtype, v.sizes[0], v.sizes[1], v.strides[0], v.strides[1]};
}

// C[rows, cols] = A · B through `epilogue`, in task_m x block_n tasks (block_n columns of C).
void ParallelGemm(const GemmKernels& kernels, const ConstMatrix& a, const ConstMatrix& b, const MutableMatrix& c,
                  int64_t rows, int64_t cols, const GatedLinearUnitConfig& config, const GemmEpilogue& epilogue) {
  if (rows == 0 || cols == 0) return;
  const int64_t row_tasks = CeilDiv(rows, config.task_m), col_tasks = CeilDiv(cols, config.block_n);
  const int64_t num_tasks = row_tasks * col_tasks;
  std::atomic<int64_t> next_task{0};
  ParallelFor(0, num_tasks, 1, [&](int64_t, int64_t) {
    for (int64_t t = next_task.fetch_add(1); t < num_tasks; t = next_task.fetch_add(1)) {
      // Column-major task order: neighbouring tasks share a column block of B (packed per task).
      const int64_t m0 = (t % row_tasks) * config.task_m, n0 = (t / row_tasks) * config.block_n;
      const int64_t m1 = std::min(m0 + config.task_m, rows), n1 = std::min(n0 + config.block_n, cols);
      GemmBlocking blocking;
      blocking.block_m = config.block_m;
      blocking.block_k = config.block_k;
      blocking.block_n = config.block_n;
      blocking.pack_b = m1 - m0 >= kGemmPackBMinRows;
      GemmRegion(kernels, a, b, c, m0, m1, n0, n1, blocking, epilogue);
    }
  });
}

template <typename T>
inline double LoadWide(const void* p) {
  if constexpr (std::is_same_v<T, double>) {
    return *static_cast<const double*>(p);
  } else {
    return LoadAsFloat(static_cast<const T*>(p));
  }
}

template <typename T, typename Wide>
inline void StoreWide(void* p, Wide x) {
  if constexpr (std::is_same_v<T, double>) {
    *static_cast<double*>(p) = static_cast<double>(x);
  } else {
    StoreFromFloat(static_cast<T*>(p), static_cast<float>(x));
  }
}

// dpre(i, n) = dout · up · activation'(gate) and dpre(i, N + n) = dout · activation(gate), in
// fp32 (double for float64).
// Rows whose dout, residuals and dpre are contiguous take the tier's vector row (`row`).
template <typename T>
void PreActivationGrads(const GatedLinearUnitBackwardParams& p, GluRowGradsFn row) {
  using Wide = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t rows = p.dout.sizes[0], n = p.dout.sizes[1];
  const Activation activation = p.activation;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(n, 1));
  const bool contiguous = row != nullptr && p.dout.strides[1] == 1 && p.residuals.strides[2] == 1 &&
                          p.dpre.strides[1] == 1;
  ParallelFor(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (contiguous) {
        row(p.dout.At(i, 0), p.residuals.At(i, 0, 0), p.residuals.At(i, 1, 0), p.dpre.At(i, 0), p.dpre.At(i, n), n);
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {
        const Wide dy = static_cast<Wide>(LoadWide<T>(p.dout.At(i, j)));
        const Wide g = static_cast<Wide>(LoadWide<T>(p.residuals.At(i, 0, j)));
        const Wide u = static_cast<Wide>(LoadWide<T>(p.residuals.At(i, 1, j)));
        StoreWide<T>(p.dpre.At(i, j), dy * u * ActivationDerivative<Wide>(activation, g));
        StoreWide<T>(p.dpre.At(i, n + j), dy * Activate<Wide>(activation, g));
      }
    }
  });
}

}  // namespace

Status ParseGluActivation(const std::string& name, Activation* activation) {
  if (name == "swish" || name == "silu") *activation = Activation::kSilu;
  else if (name == "gelu") *activation = Activation::kGeluTanh;
  else if (name == "gelu_exact") *activation = Activation::kGeluErf;
  else if (name == "relu") *activation = Activation::kRelu;
  else if (name == "sigmoid") *activation = Activation::kSigmoid;
  else if (name == "none") *activation = Activation::kNone;
  else {
    return Status::Error("gated_linear_unit: activation must be one of swish (silu), gelu, gelu_exact, relu, "
                         "sigmoid or None, got '" + name + "'");
  }
  return Status::Ok();
}

Status GatedLinearUnit(const GatedLinearUnitParams& p, const GatedLinearUnitConfig& config) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  Isa isa;
  status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  const int64_t rows = p.x.sizes[0], n = p.gate.sizes[1];
  GemmGate gate;
  gate.up = MatrixOf(p.up);
  if (p.residuals.data != nullptr) {
    const MutableStridedView<3>& r = p.residuals;
    gate.gate_out = {r.At(0, 0, 0), r.dtype, rows, n, r.strides[0], r.strides[2]};
    gate.up_out = {r.At(0, 1, 0), r.dtype, rows, n, r.strides[0], r.strides[2]};
  }
  GemmEpilogue epilogue;
  epilogue.activation = p.activation;
  epilogue.gate = &gate;
  ParallelGemm(GetGemmKernels(isa), MatrixOf(p.x), MatrixOf(p.gate), MutableMatrixOf(p.out), rows, n, config,
               epilogue);
  return Status::Ok();
}

Status GatedLinearUnitBackward(const GatedLinearUnitBackwardParams& p, const GatedLinearUnitConfig& config) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  Isa isa;
  status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  const GemmKernels& kernels = GetGemmKernels(isa);
  const GluRowGradsFn row = RowGradsOf(isa, p.dout.dtype, p.activation);
  DispatchDType(p.dout.dtype, [&](auto tag) {
    PreActivationGrads<decltype(tag)>(p, row);
    return 0;
  });
  const StridedView<2> dpre = p.dpre.AsConst();
  const int64_t rows = p.x.sizes[0], k = p.x.sizes[1], n2 = p.dpre.sizes[1];
  if (p.dx.data != nullptr) {  // dx [M, K] = dpre [M, 2N] · weightsᵀ [2N, K]
    ParallelGemm(kernels, MatrixOf(dpre), TransposedMatrixOf(p.weights), MutableMatrixOf(p.dx), rows, k, config, {});
  }
  if (p.dweights.data != nullptr) {  // dweights [K, 2N] = xᵀ [K, M] · dpre [M, 2N]
    ParallelGemm(kernels, TransposedMatrixOf(p.x), MatrixOf(dpre), MutableMatrixOf(p.dweights), k, n2, config, {});
  }
  return Status::Ok();
}

void GatedLinearUnitReference(const GatedLinearUnitParams& p) {
  const int64_t rows = p.x.sizes[0], k = p.x.sizes[1], n = p.gate.sizes[1];
  DispatchDType(p.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double g = 0.0, u = 0.0;
        for (int64_t q = 0; q < k; ++q) {
          const double x = LoadWide<T>(p.x.At(i, q));
          g += x * LoadWide<T>(p.gate.At(q, j));
          u += x * LoadWide<T>(p.up.At(q, j));
        }
        StoreWide<T>(p.out.At(i, j), Activate(p.activation, g) * u);
        if (p.residuals.data != nullptr) {
          StoreWide<T>(p.residuals.At(i, 0, j), g);
          StoreWide<T>(p.residuals.At(i, 1, j), u);
        }
      }
    }
    return 0;
  });
}

}  // namespace tokamax
