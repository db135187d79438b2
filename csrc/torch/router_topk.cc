// tokamax::router_topk and tokamax::router_topk_reference: the schema, the one argument check,
// the CPU kernel adapter, the ATen reference (a stable sort) and the SymInt meta kernel. No
// configs (a row scan has nothing to tile) and no autograd (upstream defines no gradient).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "csrc/ops/topk/topk.h"
#include "csrc/torch/adapter_utils.h"

namespace tokamax {
namespace {

using at::Tensor;
constexpr const char* kOp = "router_topk";

// The one argument check: kernel, reference and Meta call it. Metadata only (SymInt-safe).
void CheckRouterTopKArgs(const Tensor& scores, const c10::SymInt& k) {
  TORCH_CHECK(scores.dim() == 2, kOp, ": scores must be 2-D [T, E], got shape ", ShapeString(scores));
  const at::ScalarType dtype = scores.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kOp,
              ": scores must be float32, bfloat16 or float16, got ", dtype);
  const c10::SymInt experts = scores.sym_size(1);
  TORCH_SYM_CHECK(k.sym_ge(1) & k.sym_le(experts), kOp, ": k must be in [1, E=", experts, "], got ", k);
}

std::tuple<Tensor, Tensor> RouterTopKCpu(const Tensor& scores, int64_t k) {
  CheckRouterTopKArgs(scores, k);
  Tensor weights = NewOutput({scores.size(0), k}, scores.options().dtype(at::kFloat));
  Tensor indices = NewOutput({scores.size(0), k}, scores.options().dtype(at::kInt));
  RouterTopKParams params;
  params.scores = StridedViewOf<2>(scores, kOp);
  params.k = k;
  params.weights = weights.data_ptr<float>();
  params.indices = indices.data_ptr<int32_t>();
  const Status status = RouterTopK(params);
  TORCH_CHECK(status.ok(), status.message());
  return {weights, indices};
}

std::tuple<Tensor, Tensor> RouterTopKMeta(const Tensor& scores, c10::SymInt k) {
  CheckRouterTopKArgs(scores, k);
  const std::vector<c10::SymInt> shape{scores.sym_size(0), k};
  return {at::empty_symint(shape, scores.options().dtype(at::kFloat)),
          at::empty_symint(shape, scores.options().dtype(at::kInt))};
}

// Upstream's k arg-max passes, as one stable descending sort of the clamped scores: equal keys
// keep column order, so ties go to the lowest id and the bad (clamped) columns come last in id
// order. torch.topk promises no tie order, hence the sort.
std::tuple<Tensor, Tensor> RouterTopKReference(const Tensor& scores, c10::SymInt k) {
  CheckRouterTopKArgs(scores, k);
  const Tensor wide = scores.to(at::kFloat);
  const Tensor keys = at::where(wide > kRouterTopKFloor, wide, at::scalar_tensor(kRouterTopKFloor, wide.options()));
  const auto [sorted, order] = at::sort(keys, /*stable=*/true, /*dim=*/1, /*descending=*/true);
  Tensor weights = sorted.slice_symint(1, 0, k);
  // A row whose best key is the floor has no good score: NaN weights (its ids are 0..k-1).
  const Tensor no_good = weights.slice(1, 0, 1) <= kRouterTopKFloor;
  weights = at::where(no_good, at::scalar_tensor(std::numeric_limits<float>::quiet_NaN(), wide.options()), weights);
  // Contiguous, as the kernel's and the Meta kernel's outputs (the slices are strided).
  return {weights.contiguous(), order.slice_symint(1, 0, k).to(at::kInt).contiguous()};
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_ROUTER_TOPK_ARGS "(Tensor scores, SymInt k) -> (Tensor weights, Tensor indices)"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("router_topk" TOKAMAX_ROUTER_TOPK_ARGS);
  m.def("router_topk_reference" TOKAMAX_ROUTER_TOPK_ARGS);
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) { m.impl("router_topk", &tokamax::RouterTopKCpu); }

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("router_topk", &tokamax::RouterTopKMeta);
  m.impl("router_topk_reference", &tokamax::RouterTopKMeta);
}

// Explicit, not implicit: the reference is as non-differentiable as the kernel (upstream defines
// no gradient), instead of differentiating through the sort; see the Autograd registration.
TORCH_LIBRARY_IMPL(tokamax, CompositeExplicitAutograd, m) {
  m.impl("router_topk_reference", &tokamax::RouterTopKReference);
}

// No gradient (upstream defines none): outputs never require grad, for both singletons.
TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("router_topk", torch::CppFunction::makeFromBoxedFunction<&tokamax::RunBelowAutograd>());
  m.impl("router_topk_reference", torch::CppFunction::makeFromBoxedFunction<&tokamax::RunBelowAutograd>());
}
