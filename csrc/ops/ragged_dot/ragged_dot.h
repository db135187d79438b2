// ragged_dot: the grouped matrix product of mixture-of-experts layers (jax.lax.ragged_dot).
//
// Three dimension-number forms, the forward product and its two gradients:
//   kDefault            lhs[M,K] · rhs[G,K,N] -> out[M,N]; group g owns rows
//                       [sum(gs[:g]), sum(gs[:g+1])) and multiplies them by rhs[g].
//   kTransRhs           lhs[M,K] · rhs[G,N,K]ᵀ -> out[M,N] (the lhs gradient).
//   kRaggedContracting  lhs[M,K], rhs[M,N] -> out[G,K,N], out[g] = lhs_rows(g)ᵀ · rhs_rows(g)
//                       (the rhs gradient).
// Rows past sum(group_sizes) are written with zeros (forms 0 and 1); empty groups give zero
// blocks (form 2). Torch-free: the adapter passes pointers, sizes and element strides.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/base/config_fields.h"
#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/base/dtype.h"
#include "csrc/core/base/status.h"
#include "csrc/core/base/strided_view.h"

namespace tokamax {

enum class RaggedDotForm : int { kDefault = 0, kTransRhs = 1, kRaggedContracting = 2 };

const char* RaggedDotFormName(RaggedDotForm form);

// Flat dimension numbers as Tokamax serialises them: six list lengths, then the lists
// (lhs_contract, rhs_contract, lhs_batch, rhs_batch, lhs_ragged, rhs_group).
Status ParseRaggedDotDimensionNumbers(const std::vector<int64_t>& flat, RaggedDotForm* form);
std::vector<int64_t> RaggedDotDimensionNumbers(RaggedDotForm form);

// The adapter's name for the view (csrc/torch builds it); kernels spell StridedView<3>.
using Tensor3View = StridedView<3>;

struct RaggedDotParams {
  RaggedDotForm form = RaggedDotForm::kDefault;
  StridedView<3> lhs;  // [M, K] in sizes[0..1]
  StridedView<3> rhs;  // [G, K, N], [G, N, K] or [M, N] (form 2, sizes[0..1])
  const int64_t* group_sizes = nullptr;  // [G], validated by CheckRaggedDotGroupSizes
  int64_t num_groups = 0;
  void* out = nullptr;           // [M, N] or [G, K, N]
  DType out_dtype = DType::kFloat32;
  int64_t out_strides[3] = {0, 0, 0};
};

// The problem's shape as heuristics and cache keys see it.
struct RaggedDotShape {
  RaggedDotForm form = RaggedDotForm::kDefault;
  int64_t m = 0;  // rows of lhs (the ragged dimension)
  int64_t k = 0;  // columns of lhs
  int64_t n = 0;  // the output's last dimension
  int64_t g = 0;  // number of groups
};

// Knobs of the CPU kernel, in the order they cross the schema as int[]:
//   X(name, default, min, max, multiple_of, meaning). Rules tying fields together live in
// RaggedDotConfig::ValidateCrossFields (task_m a multiple of block_m, scratch limits).
#define TOKAMAX_RAGGED_DOT_CONFIG_FIELDS(X)                                                       \
  X(block_m, 144, 6, 1536, 6, "rows of A packed at once")                                          \
  X(block_k, 256, 1, 8192, 1, "depth of one packed slice of K")                                    \
  X(block_n, 512, 16, 8192, 16, "columns per task and per packed B block")                         \
  X(task_m, 1152, 6, 65536, 1, "rows per parallel task; a multiple of block_m")                   \
  X(pack_b_min_rows, 12, 0, (int64_t{1} << 30), 1,                                                \
    "a task with fewer rows reads B in place instead of packing it")
// The products configured and tuned separately: the call itself, then its two gradients (the
// lhs gradient and the rhs gradient, each itself a ragged_dot; see RaggedDotProductShape).
#define TOKAMAX_RAGGED_DOT_PRODUCTS(X) X(kForward, "forward") X(kDlhs, "dlhs") X(kDrhs, "drhs")

struct RaggedDotConfig {
  TOKAMAX_CONFIG_BODY(RaggedDotConfig, "ragged_dot", TOKAMAX_RAGGED_DOT_CONFIG_FIELDS, TOKAMAX_RAGGED_DOT_PRODUCTS)
};
using RaggedDotProduct = RaggedDotConfig::Product;

// The shape of `product` of a call with shape `call` (the call itself for kForward).
RaggedDotShape RaggedDotProductShape(const RaggedDotShape& call, RaggedDotProduct product);
// Pure functions of the call's shape, the input dtype, the CPU and the product; the config of a
// product is that of a forward call with the product's shape.
RaggedDotConfig RaggedDotHeuristicConfig(const RaggedDotShape& call, DType dtype, const CpuInfo& cpu,
                                         RaggedDotProduct product);
// Candidates for the autotuner: valid configs around the heuristic one, heuristic first.
std::vector<RaggedDotConfig> RaggedDotConfigSpace(const RaggedDotShape& call, DType dtype, const CpuInfo& cpu,
                                                  RaggedDotProduct product);

// Group sizes must be non-negative and sum to at most `rows` (the rows of lhs).
Status CheckRaggedDotGroupSizes(const int64_t* group_sizes, int64_t num_groups, int64_t rows);

// Runs the product with the active ISA tier and the installed parallel backend.
Status RaggedDot(const RaggedDotParams& params, const RaggedDotConfig& config);

// Plain float64 loops over the same params: the oracle of the C++ tests.
void RaggedDotReference(const RaggedDotParams& params);

}  // namespace tokamax
