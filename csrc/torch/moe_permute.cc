// tokamax::moe_permute and its reference: the schema, the one argument check, the CPU kernel, the
// ATen reference (a stable argsort and a bincount) and the SymInt Meta kernel. No configs (a
// counting sort has nothing to tune) and no gradient (integer outputs).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "csrc/ops/moe_gather/moe_gather.h"
#include "csrc/torch/adapter_utils.h"

namespace tokamax {
namespace {

using at::Tensor;
constexpr const char* kOp = "moe_permute";

// The one argument check: kernel, reference and Meta call it. Metadata only (SymInt-safe); the
// id values are checked by the kernel and the reference before they write.
void CheckMoePermuteArgs(const Tensor& expert_indices, const c10::SymInt& num_experts) {
  TORCH_CHECK(expert_indices.dim() == 2, kOp, ": expert_indices must be 2-D [T, k], got shape ",
              ShapeString(expert_indices));
  TORCH_CHECK(expert_indices.scalar_type() == at::kInt || expert_indices.scalar_type() == at::kLong, kOp,
              ": expert_indices must be int32 or int64, got ", expert_indices.scalar_type());
  TORCH_SYM_CHECK(num_experts.sym_ge(1), kOp, ": num_experts must be >= 1, got ", num_experts);
}

std::vector<c10::SymInt> FlatShape(const Tensor& expert_indices) {
  return {expert_indices.sym_size(0) * expert_indices.sym_size(1)};
}

std::tuple<Tensor, Tensor, Tensor> MoePermuteMeta(const Tensor& expert_indices, c10::SymInt num_experts) {
  CheckMoePermuteArgs(expert_indices, num_experts);
  const auto options = expert_indices.options().dtype(at::kLong);
  return {at::empty_symint(FlatShape(expert_indices), options), at::empty_symint(FlatShape(expert_indices), options),
          at::empty_symint({num_experts}, options.dtype(at::kInt))};
}

std::tuple<Tensor, Tensor, Tensor> MoePermuteCpu(const Tensor& expert_indices, int64_t num_experts) {
  CheckMoePermuteArgs(expert_indices, num_experts);
  const int64_t n = expert_indices.size(0) * expert_indices.size(1);
  const auto options = expert_indices.options().dtype(at::kLong);
  Tensor order = NewOutput({n}, options), inverse = NewOutput({n}, options);
  Tensor group_sizes = NewOutput({num_experts}, options.dtype(at::kInt));
  MoePermuteParams params;
  params.expert_indices = {expert_indices.const_data_ptr(), expert_indices.scalar_type() == at::kLong,
                           expert_indices.size(0), expert_indices.size(1), expert_indices.stride(0),
                           expert_indices.stride(1)};
  params.num_experts = num_experts;
  params.order = order.data_ptr<int64_t>();
  params.inverse = inverse.data_ptr<int64_t>();
  params.group_sizes = group_sizes.data_ptr<int32_t>();
  const Status status = MoePermute(params);
  TORCH_CHECK(status.ok(), status.message());
  return {order, inverse, group_sizes};
}

// Plain ATen: a stable argsort of the flattened ids (ties in flattened order), its inverse by a
// scatter of positions, and a bincount. The range check reads values, so this is a CPU kernel
// with the Meta kernel above, not a composite.
std::tuple<Tensor, Tensor, Tensor> MoePermuteReference(const Tensor& expert_indices, int64_t num_experts) {
  CheckMoePermuteArgs(expert_indices, num_experts);
  const Tensor flat = expert_indices.reshape({-1}).to(at::kLong);
  const Tensor bad = (flat < 0).logical_or(flat >= num_experts).nonzero();
  if (bad.numel() > 0) {
    const int64_t i = bad[0][0].item<int64_t>(), k = expert_indices.size(1);
    TORCH_CHECK(false, kOp, ": expert_indices[", i / k, ", ", i % k, "] must be in [0, num_experts=", num_experts,
                "), got ", flat[i].item<int64_t>());
  }
  const Tensor order = std::get<1>(at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const Tensor inverse = at::empty_like(order).scatter_(0, order, at::arange(flat.size(0), order.options()));
  const Tensor group_sizes = at::bincount(flat, {}, num_experts).to(at::kInt);
  return {order, inverse, group_sizes};
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_MOE_PERMUTE_ARGS \
  "(Tensor expert_indices, SymInt num_experts) -> (Tensor order, Tensor inverse, Tensor group_sizes)"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("moe_permute" TOKAMAX_MOE_PERMUTE_ARGS);
  m.def("moe_permute_reference" TOKAMAX_MOE_PERMUTE_ARGS);
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("moe_permute", &tokamax::MoePermuteCpu);
  m.impl("moe_permute_reference", &tokamax::MoePermuteReference);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("moe_permute", &tokamax::MoePermuteMeta);
  m.impl("moe_permute_reference", &tokamax::MoePermuteMeta);
}

// Integer outputs: no gradient, for both singletons.
TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("moe_permute", torch::CppFunction::makeFromBoxedFunction<&tokamax::RunBelowAutograd>());
  m.impl("moe_permute_reference", torch::CppFunction::makeFromBoxedFunction<&tokamax::RunBelowAutograd>());
}
