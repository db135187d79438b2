// tokamax::ragged_gather_reduce (the MoE combine) and its reference: the schema, the one argument
// check, the CPU kernel and its backward op, the ATen reference, SymInt Meta kernels and C++
// autograd. No configs (a gather and a short sum per token have nothing to tune).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "csrc/ops/moe_gather/moe_gather.h"
#include "csrc/torch/adapter_utils.h"
#include "csrc/torch/op_kit.h"

namespace tokamax {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;
constexpr const char* kOp = "ragged_gather_reduce";

// The one argument check: kernel, reference, Meta, autograd and the backward call it. Metadata
// only (SymInt-safe); the index values are checked by the kernels before they write.
void CheckRaggedGatherReduceArgs(const Tensor& x, const Tensor& indices, const Tensor& topk_weights,
                                 const Tensor& valid_rows_mask, const c10::SymInt& reduce_group_size) {
  TORCH_CHECK(x.dim() == 2, kOp, ": x must be 2-D [R, H], got shape ", ShapeString(x));
  TORCH_CHECK(IsSupportedFloat(x.scalar_type()), kOp, ": x must be float32, bfloat16, float16 or float64, got ",
              x.scalar_type());
  TORCH_CHECK(indices.dim() == 1, kOp, ": indices must be 1-D [N], got shape ", ShapeString(indices));
  TORCH_CHECK(indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong, kOp,
              ": indices must be int32 or int64, got ", indices.scalar_type());
  TORCH_CHECK(topk_weights.dim() == 1 && IsSupportedFloat(topk_weights.scalar_type()), kOp,
              ": topk_weights must be a 1-D [N] float tensor, got ", topk_weights.scalar_type(),
              ShapeString(topk_weights));
  TORCH_CHECK(valid_rows_mask.dim() == 1 && valid_rows_mask.scalar_type() == at::kBool, kOp,
              ": valid_rows_mask must be a 1-D [N] bool tensor, got ", valid_rows_mask.scalar_type(),
              ShapeString(valid_rows_mask));
  for (const Tensor* t : {&indices, &topk_weights, &valid_rows_mask}) {
    TORCH_CHECK(t->device() == x.device(), kOp, ": every tensor must be on x's device ", x.device(), ", got ",
                t->device());
  }
  const c10::SymInt n = indices.sym_size(0);
  TORCH_SYM_CHECK(topk_weights.sym_size(0).sym_eq(n), kOp, ": topk_weights must have one weight per index, [N] = [",
                  n, "], got shape ", ShapeString(topk_weights));
  TORCH_SYM_CHECK(valid_rows_mask.sym_size(0).sym_eq(n), kOp,
                  ": valid_rows_mask must have one flag per index, [N] = [", n, "], got shape ",
                  ShapeString(valid_rows_mask));
  TORCH_SYM_CHECK(reduce_group_size.sym_ge(1), kOp, ": reduce_group_size must be >= 1, got ", reduce_group_size);
  TORCH_SYM_CHECK((n % reduce_group_size).sym_eq(0), kOp, ": reduce_group_size must divide N=", n, ", got ",
                  reduce_group_size);
}

IndexVector IndexVectorOf(const Tensor& indices) {
  return {indices.const_data_ptr(), indices.scalar_type() == at::kLong, indices.size(0), indices.stride(0)};
}

RaggedGatherReduceParams ParamsOf(const Tensor& x, const Tensor& indices, const Tensor& topk_weights,
                                  const Tensor& valid_rows_mask, int64_t reduce_group_size) {
  RaggedGatherReduceParams params;
  params.x = StridedViewOf<2>(x, kOp);
  params.indices = IndexVectorOf(indices);
  params.topk_weights = StridedViewOf<1>(topk_weights, kOp);
  params.valid = reinterpret_cast<const uint8_t*>(valid_rows_mask.const_data_ptr<bool>());
  params.valid_stride = valid_rows_mask.stride(0);
  params.group_size = reduce_group_size;
  return params;
}

Tensor RaggedGatherReduceCpu(const Tensor& x, const Tensor& indices, const Tensor& topk_weights,
                             const Tensor& valid_rows_mask, int64_t reduce_group_size) {
  CheckRaggedGatherReduceArgs(x, indices, topk_weights, valid_rows_mask, reduce_group_size);
  Tensor out = NewOutput({indices.size(0) / reduce_group_size, x.size(1)}, x.options());
  RaggedGatherReduceParams params = ParamsOf(x, indices, topk_weights, valid_rows_mask, reduce_group_size);
  params.out = MutableStridedViewOf<2>(out, kOp);
  const Status status = RaggedGatherReduce(params);
  TORCH_CHECK(status.ok(), status.message());
  return out;
}

std::tuple<Tensor, Tensor> RaggedGatherReduceBackwardCpu(const Tensor& dout, const Tensor& x, const Tensor& indices,
                                                         const Tensor& topk_weights, const Tensor& valid_rows_mask,
                                                         int64_t reduce_group_size) {
  CheckRaggedGatherReduceArgs(x, indices, topk_weights, valid_rows_mask, reduce_group_size);
  const int64_t tokens = indices.size(0) / reduce_group_size;
  TORCH_CHECK(dout.dim() == 2 && dout.size(0) == tokens && dout.size(1) == x.size(1) &&
                  dout.scalar_type() == x.scalar_type(),
              kOp, " backward: dout must be ", x.scalar_type(), "[", tokens, ", ", x.size(1), "], got ",
              dout.scalar_type(), ShapeString(dout));
  Tensor dx = NewOutput(x.sizes(), x.options());
  Tensor dw = NewOutput({indices.size(0)}, topk_weights.options());
  RaggedGatherReduceParams params = ParamsOf(x, indices, topk_weights, valid_rows_mask, reduce_group_size);
  params.dout = StridedViewOf<2>(dout, kOp);
  params.dx = MutableStridedViewOf<2>(dx, kOp);
  params.dtopk_weights = MutableStridedViewOf<1>(dw, kOp);
  const Status status = RaggedGatherReduceBackward(params);
  TORCH_CHECK(status.ok(), status.message());
  return {dx, dw};
}

Tensor RaggedGatherReduceMeta(const Tensor& x, const Tensor& indices, const Tensor& topk_weights,
                              const Tensor& valid_rows_mask, c10::SymInt reduce_group_size) {
  CheckRaggedGatherReduceArgs(x, indices, topk_weights, valid_rows_mask, reduce_group_size);
  return at::empty_symint({indices.sym_size(0) / reduce_group_size, x.sym_size(1)}, x.options());
}

std::tuple<Tensor, Tensor> RaggedGatherReduceBackwardMeta(const Tensor& dout, const Tensor& x, const Tensor& indices,
                                                          const Tensor& topk_weights, const Tensor& valid_rows_mask,
                                                          c10::SymInt reduce_group_size) {
  CheckRaggedGatherReduceArgs(x, indices, topk_weights, valid_rows_mask, reduce_group_size);
  return {at::empty_symint(x.sym_sizes(), x.options()),
          at::empty_symint({indices.sym_size(0)}, topk_weights.options())};
}

// Plain ATen in fp32 (float64 for float64 x): autograd and shapes by decomposition. Rows that are
// not valid gather row 0 (their index may be anything) and are replaced by zeros, so a NaN there
// never reaches the sum. It checks no index values: an out-of-range valid index fails in
// index_select with ATen's message.
Tensor RaggedGatherReduceReference(const Tensor& x, const Tensor& indices, const Tensor& topk_weights,
                                   const Tensor& valid_rows_mask, c10::SymInt reduce_group_size) {
  CheckRaggedGatherReduceArgs(x, indices, topk_weights, valid_rows_mask, reduce_group_size);
  const at::ScalarType wide = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // Invalid rows: zero rows times zero weights, so neither a NaN in them nor an index out of
  // range (x may have no rows) reaches the sum or the gradients.
  const Tensor weights = at::where(valid_rows_mask, topk_weights.to(wide), at::zeros_like(topk_weights, wide));
  const Tensor kept = GatherRowsOrZero(x.to(wide), indices, valid_rows_mask) * weights.unsqueeze(1);
  return kept.view_symint({indices.sym_size(0) / reduce_group_size, reduce_group_size, x.sym_size(1)})
      .sum(1)
      .to(x.scalar_type());
}

// ---- autograd: the backward is a registered op, so compiled graphs record it --------------------

using ForwardSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, c10::SymInt);
using BackwardSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                     const Tensor&, c10::SymInt);

class RaggedGatherReduceFunction : public torch::autograd::Function<RaggedGatherReduceFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& indices, const Tensor& topk_weights,
                        const Tensor& valid_rows_mask, c10::SymInt reduce_group_size) {
    ctx->saved_data["reduce_group_size"] = reduce_group_size;
    ctx->save_for_backward({x, indices, topk_weights, valid_rows_mask});
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("tokamax::ragged_gather_reduce", "")
                               .typed<ForwardSignature>();
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, indices, topk_weights, valid_rows_mask, reduce_group_size);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("tokamax::_ragged_gather_reduce_backward", "")
                               .typed<BackwardSignature>();
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = op.call(grads[0], saved[0], saved[1], saved[2], saved[3],
                            ctx->saved_data["reduce_group_size"].toSymInt());
    return {dx, Tensor(), dw, Tensor(), Tensor()};
  }
};

Tensor RaggedGatherReduceAutograd(const Tensor& x, const Tensor& indices, const Tensor& topk_weights,
                                  const Tensor& valid_rows_mask, c10::SymInt reduce_group_size) {
  if (auto reference = RunReferenceWhereFunctionCannot<Tensor>(kOp, x, indices, topk_weights, valid_rows_mask,
                                                          reduce_group_size)) {
    return *reference;
  }
  return RaggedGatherReduceFunction::apply(x, indices, topk_weights, valid_rows_mask, reduce_group_size);
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_RAGGED_GATHER_REDUCE_ARGS \
  "(Tensor x, Tensor indices, Tensor topk_weights, Tensor valid_rows_mask, SymInt reduce_group_size) -> Tensor"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("ragged_gather_reduce" TOKAMAX_RAGGED_GATHER_REDUCE_ARGS);
  m.def("ragged_gather_reduce_reference" TOKAMAX_RAGGED_GATHER_REDUCE_ARGS);
  m.def("_ragged_gather_reduce_backward(Tensor dout, Tensor x, Tensor indices, Tensor topk_weights, "
        "Tensor valid_rows_mask, SymInt reduce_group_size) -> (Tensor dx, Tensor dtopk_weights)");
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("ragged_gather_reduce", &tokamax::RaggedGatherReduceCpu);
  m.impl("_ragged_gather_reduce_backward", &tokamax::RaggedGatherReduceBackwardCpu);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("ragged_gather_reduce", &tokamax::RaggedGatherReduceMeta);
  m.impl("_ragged_gather_reduce_backward", &tokamax::RaggedGatherReduceBackwardMeta);
}

TORCH_LIBRARY_IMPL(tokamax, CompositeImplicitAutograd, m) {
  m.impl("ragged_gather_reduce_reference", &tokamax::RaggedGatherReduceReference);
}

TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("ragged_gather_reduce", &tokamax::RaggedGatherReduceAutograd);
}
