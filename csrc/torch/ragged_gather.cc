// tokamax::ragged_gather and tokamax::ragged_scatter (masked row gathers of the MoE dispatch)
// and their references: the schemas, the one argument check they share, the CPU kernels and the
// backward op over the ragged_gather_reduce core (group size 1, no weights, a range rule instead
// of a mask), ATen references, SymInt Meta kernels and C++ autograd. No configs.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "csrc/ops/moe_gather/moe_gather.h"
#include "csrc/torch/adapter_utils.h"
#include "csrc/torch/op_kit.h"

namespace tokamax {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

const char* OpName(bool by_index) { return by_index ? "ragged_scatter" : "ragged_gather"; }

// The one argument check of both ops: kernels, references, Meta, autograd and the backward call
// it. Metadata only (SymInt-safe); start, end and the indices are checked by the kernels.
void CheckRaggedGatherArgs(const char* op, const Tensor& x, const Tensor& indices, const Tensor& start,
                           const Tensor& end) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [R, H], got shape ", ShapeString(x));
  TORCH_CHECK(IsSupportedFloat(x.scalar_type()), op, ": x must be float32, bfloat16, float16 or float64, got ",
              x.scalar_type());
  TORCH_CHECK(indices.dim() == 1, op, ": indices must be 1-D [N], got shape ", ShapeString(indices));
  TORCH_CHECK(indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong, op,
              ": indices must be int32 or int64, got ", indices.scalar_type());
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"start", &start}, {"end", &end}}) {
    TORCH_CHECK(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, op, ": ", name,
                " must be an int32 or int64 tensor of one element, got ", t->scalar_type());
    TORCH_SYM_CHECK(t->sym_numel().sym_eq(1).sym_and(t->dim() <= 1), op, ": ", name,
                    " must be an int32 or int64 tensor of one element, got shape ", ShapeString(*t));
  }
  for (const Tensor* t : {&indices, &start, &end}) {
    TORCH_CHECK(t->device() == x.device(), op, ": every tensor must be on x's device ", x.device(), ", got ",
                t->device());
  }
}

RaggedGatherReduceParams ParamsOf(bool by_index, const Tensor& x, const Tensor& indices, const Tensor& start,
                                  const Tensor& end) {
  RaggedGatherReduceParams params;
  params.op = OpName(by_index);
  params.x = StridedViewOf<2>(x, params.op);
  params.indices = {indices.const_data_ptr(), indices.scalar_type() == at::kLong, indices.size(0), indices.stride(0)};
  params.range = by_index ? RowRange::kIndex : RowRange::kPosition;
  params.start = start.item<int64_t>();
  params.end = end.item<int64_t>();
  return params;
}

Tensor GatherCpu(bool by_index, const Tensor& x, const Tensor& indices, const Tensor& start, const Tensor& end) {
  CheckRaggedGatherArgs(OpName(by_index), x, indices, start, end);
  Tensor out = NewOutput({indices.size(0), x.size(1)}, x.options());
  RaggedGatherReduceParams params = ParamsOf(by_index, x, indices, start, end);
  params.out = MutableStridedViewOf<2>(out, params.op);
  const Status status = RaggedGatherReduce(params);
  TORCH_CHECK(status.ok(), status.message());
  return out;
}

Tensor RaggedGatherCpu(const Tensor& x, const Tensor& indices, const Tensor& start, const Tensor& end) {
  return GatherCpu(false, x, indices, start, end);
}

Tensor RaggedScatterCpu(const Tensor& x, const Tensor& indices, const Tensor& start, const Tensor& end) {
  return GatherCpu(true, x, indices, start, end);
}

// dx[r] = the sum of dout[j] over the selected j with indices[j] == r, j ascending (no atomics).
Tensor RaggedGatherBackwardCpu(const Tensor& dout, const Tensor& x, const Tensor& indices, const Tensor& start,
                               const Tensor& end, bool by_index) {
  const char* op = OpName(by_index);
  CheckRaggedGatherArgs(op, x, indices, start, end);
  TORCH_CHECK(dout.dim() == 2 && dout.size(0) == indices.size(0) && dout.size(1) == x.size(1) &&
                  dout.scalar_type() == x.scalar_type(),
              op, " backward: dout must be ", x.scalar_type(), "[", indices.size(0), ", ", x.size(1), "], got ",
              dout.scalar_type(), ShapeString(dout));
  Tensor dx = NewOutput(x.sizes(), x.options());
  RaggedGatherReduceParams params = ParamsOf(by_index, x, indices, start, end);
  params.dout = StridedViewOf<2>(dout, op);
  params.dx = MutableStridedViewOf<2>(dx, op);
  const Status status = RaggedGatherReduceBackward(params);
  TORCH_CHECK(status.ok(), status.message());
  return dx;
}

Tensor GatherMeta(bool by_index, const Tensor& x, const Tensor& indices, const Tensor& start, const Tensor& end) {
  CheckRaggedGatherArgs(OpName(by_index), x, indices, start, end);
  return at::empty_symint({indices.sym_size(0), x.sym_size(1)}, x.options());
}

Tensor RaggedGatherMeta(const Tensor& x, const Tensor& indices, const Tensor& start, const Tensor& end) {
  return GatherMeta(false, x, indices, start, end);
}

Tensor RaggedScatterMeta(const Tensor& x, const Tensor& indices, const Tensor& start, const Tensor& end) {
  return GatherMeta(true, x, indices, start, end);
}

Tensor RaggedGatherBackwardMeta(const Tensor& dout, const Tensor& x, const Tensor& indices, const Tensor& start,
                                const Tensor& end, bool by_index) {
  CheckRaggedGatherArgs(OpName(by_index), x, indices, start, end);
  return at::empty_symint(x.sym_sizes(), x.options());
}

// Plain ATen: rows not selected are zeros (GatherRowsOrZero: their index may be anything).
// Autograd and shapes by decomposition; no check of start, end or index values.
Tensor GatherReference(bool by_index, const Tensor& x, const Tensor& indices, const Tensor& start,
                       const Tensor& end) {
  CheckRaggedGatherArgs(OpName(by_index), x, indices, start, end);
  const Tensor wide_indices = indices.to(at::kLong);
  const Tensor key = by_index ? wide_indices : at::ones_like(wide_indices).cumsum(0) - 1;  // the index, or j
  const Tensor keep = (key >= start.reshape({})).logical_and(key < end.reshape({}));
  return GatherRowsOrZero(x, wide_indices, keep);
}

Tensor RaggedGatherReference(const Tensor& x, const Tensor& indices, const Tensor& start, const Tensor& end) {
  return GatherReference(false, x, indices, start, end);
}

Tensor RaggedScatterReference(const Tensor& x, const Tensor& indices, const Tensor& start, const Tensor& end) {
  return GatherReference(true, x, indices, start, end);
}

// ---- autograd: the backward is a registered op, so compiled graphs record it --------------------

using ForwardSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using BackwardSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool);

class RaggedGatherFunction : public torch::autograd::Function<RaggedGatherFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& indices, const Tensor& start,
                        const Tensor& end, bool by_index) {
    ctx->saved_data["by_index"] = by_index;
    ctx->save_for_backward({x, indices, start, end});
    static const auto gather = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("tokamax::ragged_gather", "")
                                   .typed<ForwardSignature>();
    static const auto scatter = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("tokamax::ragged_scatter", "")
                                    .typed<ForwardSignature>();
    at::AutoDispatchBelowADInplaceOrView guard;
    return (by_index ? scatter : gather).call(x, indices, start, end);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("tokamax::_ragged_gather_backward", "")
                               .typed<BackwardSignature>();
    const auto saved = ctx->get_saved_variables();
    const Tensor dx = op.call(grads[0], saved[0], saved[1], saved[2], saved[3], ctx->saved_data["by_index"].toBool());
    return {dx, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor RaggedGatherAutograd(const Tensor& x, const Tensor& indices, const Tensor& start, const Tensor& end) {
  if (auto reference = RunReferenceWhereFunctionCannot<Tensor>("ragged_gather", x, indices, start, end)) return *reference;
  return RaggedGatherFunction::apply(x, indices, start, end, false);
}

Tensor RaggedScatterAutograd(const Tensor& x, const Tensor& indices, const Tensor& start, const Tensor& end) {
  if (auto reference = RunReferenceWhereFunctionCannot<Tensor>("ragged_scatter", x, indices, start, end)) return *reference;
  return RaggedGatherFunction::apply(x, indices, start, end, true);
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_RAGGED_GATHER_ARGS "(Tensor x, Tensor indices, Tensor start, Tensor end) -> Tensor"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("ragged_gather" TOKAMAX_RAGGED_GATHER_ARGS);
  m.def("ragged_gather_reference" TOKAMAX_RAGGED_GATHER_ARGS);
  m.def("ragged_scatter" TOKAMAX_RAGGED_GATHER_ARGS);
  m.def("ragged_scatter_reference" TOKAMAX_RAGGED_GATHER_ARGS);
  // by_index: ragged_scatter's rule (start <= indices[j] < end), else ragged_gather's (start <= j < end).
  m.def("_ragged_gather_backward(Tensor dout, Tensor x, Tensor indices, Tensor start, Tensor end, bool by_index) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("ragged_gather", &tokamax::RaggedGatherCpu);
  m.impl("ragged_scatter", &tokamax::RaggedScatterCpu);
  m.impl("_ragged_gather_backward", &tokamax::RaggedGatherBackwardCpu);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("ragged_gather", &tokamax::RaggedGatherMeta);
  m.impl("ragged_scatter", &tokamax::RaggedScatterMeta);
  m.impl("_ragged_gather_backward", &tokamax::RaggedGatherBackwardMeta);
}

TORCH_LIBRARY_IMPL(tokamax, CompositeImplicitAutograd, m) {
  m.impl("ragged_gather_reference", &tokamax::RaggedGatherReference);
  m.impl("ragged_scatter_reference", &tokamax::RaggedScatterReference);
}

TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("ragged_gather", &tokamax::RaggedGatherAutograd);
  m.impl("ragged_scatter", &tokamax::RaggedScatterAutograd);
}
