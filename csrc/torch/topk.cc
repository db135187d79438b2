// tokamax::topk and tokamax::topk_reference: the schema, the one argument check, the CPU kernel
// adapter, the ATen reference (a stable sort) and the SymInt meta kernel. No configs and no
// autograd (upstream defines no gradient; the indices are integers).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <tuple>

#include "csrc/ops/topk/topk.h"
#include "csrc/torch/adapter_utils.h"

namespace tokamax {
namespace {

using at::Tensor;
constexpr const char* kOp = "topk";

// The one argument check: kernel, reference and Meta call it. Metadata only (SymInt-safe).
void CheckTopKArgs(const Tensor& scores, const c10::SymInt& k, const std::optional<Tensor>& row_lengths) {
  TORCH_CHECK(scores.dim() == 2, kOp, ": scores must be 2-D [b, n], got shape ", ShapeString(scores));
  const at::ScalarType dtype = scores.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kOp,
              ": scores must be float32, bfloat16 or float16, got ", dtype);
  const c10::SymInt n = scores.sym_size(1);
  TORCH_SYM_CHECK(k.sym_ge(1) & k.sym_le(n), kOp, ": k must be in [1, n=", n, "], got ", k);
  if (row_lengths.has_value()) {
    TORCH_CHECK(row_lengths->scalar_type() == at::kInt && row_lengths->dim() == 1, kOp,
                ": row_lengths must be int32 [b], got ", row_lengths->scalar_type(), ShapeString(*row_lengths));
    TORCH_SYM_CHECK(row_lengths->sym_size(0).sym_eq(scores.sym_size(0)), kOp, ": row_lengths must have b=",
                    scores.sym_size(0), " entries, got shape ", ShapeString(*row_lengths));
  }
}

// Without return_scores the values output is an empty tensor (an op cannot return None).
std::vector<c10::SymInt> ValuesShape(const Tensor& scores, const c10::SymInt& k, bool return_scores) {
  if (return_scores) return {scores.sym_size(0), k};
  return {c10::SymInt(0)};
}

std::tuple<Tensor, Tensor> TopKCpu(const Tensor& scores, int64_t k, const std::optional<Tensor>& row_lengths,
                                   bool return_scores) {
  CheckTopKArgs(scores, k, row_lengths);
  Tensor indices = NewOutput({scores.size(0), k}, scores.options().dtype(at::kInt));
  Tensor values = return_scores ? NewOutput({scores.size(0), k}, scores.options()) : at::empty({0}, scores.options());
  TopKParams params;
  params.scores = StridedViewOf<2>(scores, kOp);
  params.k = k;
  if (row_lengths.has_value()) {
    params.row_lengths = row_lengths->const_data_ptr<int32_t>();
    params.row_lengths_stride = row_lengths->stride(0);
  }
  params.indices = indices.data_ptr<int32_t>();
  params.values = return_scores ? values.data_ptr() : nullptr;
  const Status status = TopK(params);
  TORCH_CHECK(status.ok(), status.message());
  return {indices, values};
}

std::tuple<Tensor, Tensor> TopKMeta(const Tensor& scores, c10::SymInt k, const std::optional<Tensor>& row_lengths,
                                    bool return_scores) {
  CheckTopKArgs(scores, k, row_lengths);
  return {at::empty_symint({scores.sym_size(0), k}, scores.options().dtype(at::kInt)),
          at::empty_symint(ValuesShape(scores, k, return_scores), scores.options())};
}

// Upstream's masked top_k as one stable descending sort: ineligible columns (past the row's
// length, -inf or NaN) become -inf and sort last; equal values keep column order, so ties go to
// the lower index. torch.topk promises no tie order, hence the sort.
std::tuple<Tensor, Tensor> TopKReference(const Tensor& scores, c10::SymInt k, const std::optional<Tensor>& row_lengths,
                                         bool return_scores) {
  CheckTopKArgs(scores, k, row_lengths);
  const Tensor wide = scores.to(at::kFloat);
  const Tensor minus_inf = at::scalar_tensor(-std::numeric_limits<float>::infinity(), wide.options());
  Tensor eligible = wide > minus_inf;  // false for NaN
  if (row_lengths.has_value()) {
    const Tensor columns = at::arange(wide.sym_size(1), wide.options().dtype(at::kLong));
    eligible = eligible & (columns.unsqueeze(0) < row_lengths->to(at::kLong).unsqueeze(1));
  }
  const auto [sorted, order] = at::sort(at::where(eligible, wide, minus_inf), /*stable=*/true, /*dim=*/1,
                                        /*descending=*/true);
  const Tensor values = sorted.slice_symint(1, 0, k);
  const Tensor indices =
      at::where(values == minus_inf, at::scalar_tensor(-1, order.options()), order.slice_symint(1, 0, k)).to(at::kInt);
  // Contiguous, as the kernel's and the Meta kernel's outputs (the slices are strided).
  if (!return_scores) return {indices.contiguous(), at::empty_symint(ValuesShape(scores, k, false), scores.options())};
  return {indices.contiguous(), values.to(scores.scalar_type()).contiguous()};
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_TOPK_ARGS \
  "(Tensor scores, SymInt k, Tensor? row_lengths=None, bool return_scores=False) -> (Tensor indices, Tensor values)"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("topk" TOKAMAX_TOPK_ARGS);
  m.def("topk_reference" TOKAMAX_TOPK_ARGS);
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) { m.impl("topk", &tokamax::TopKCpu); }

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("topk", &tokamax::TopKMeta);
  m.impl("topk_reference", &tokamax::TopKMeta);
}

// Explicit, not implicit: the reference is as non-differentiable as the kernel; see the Autograd registration.
TORCH_LIBRARY_IMPL(tokamax, CompositeExplicitAutograd, m) { m.impl("topk_reference", &tokamax::TopKReference); }

// No gradient (upstream defines none): outputs never require grad, for both singletons.
TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("topk", torch::CppFunction::makeFromBoxedFunction<&tokamax::RunBelowAutograd>());
  m.impl("topk_reference", torch::CppFunction::makeFromBoxedFunction<&tokamax::RunBelowAutograd>());
}
