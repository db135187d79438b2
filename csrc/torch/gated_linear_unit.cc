// tokamax::gated_linear_unit and its reference: the schemas, the one argument check, the CPU
// kernel and its backward op, the ATen reference, Meta kernels, C++ autograd and the config
// helper ops. Weights are fused [K, 2, N] (gate, up) or a pair of [K, N] (`weights` the gate,
// `up_weights` up), any strides: transposed views are read in place.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "csrc/ops/gated_linear_unit/gated_linear_unit.h"
#include "csrc/torch/adapter_utils.h"
#include "csrc/torch/op_kit.h"

namespace tokamax {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

constexpr const char* kOp = "gated_linear_unit";

struct GluConfigs {
  std::optional<GatedLinearUnitConfig> forward, backward;
};

// The one argument check: kernel, reference, Meta, autograd and the config ops all call it.
// Reads metadata only (SymInt-safe).
GluConfigs CheckGluArgs(const Tensor& x, const Tensor& weights, const std::optional<Tensor>& up_weights,
                        c10::string_view activation, at::OptionalIntArrayRef config = std::nullopt,
                        at::OptionalIntArrayRef bwd_config = std::nullopt, Activation* parsed = nullptr) {
  GluConfigs configs{ParseOptionalConfig<GatedLinearUnitConfig>(config, "config"),
                     ParseOptionalConfig<GatedLinearUnitConfig>(bwd_config, "bwd_config")};
  Activation a;
  const Status status = ParseGluActivation(std::string(activation), &a);
  TORCH_CHECK(status.ok(), status.message());
  if (parsed != nullptr) *parsed = a;
  TORCH_CHECK(IsSupportedFloat(x.scalar_type()),
              "gated_linear_unit: x must be float32, bfloat16, float16 or float64, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 2, "gated_linear_unit: x must be [..., M, K] (at least 2-D), got shape ", ShapeString(x));
  const c10::SymInt& k = x.sym_size(-1);
  if (up_weights.has_value()) {
    TORCH_CHECK(weights.dim() == 2 && up_weights->dim() == 2,
                "gated_linear_unit: weights must be fused [K, 2, N] or a pair of [K, N], got a pair of shapes ",
                ShapeString(weights), " and ", ShapeString(*up_weights));
    TORCH_SYM_CHECK(up_weights->sym_size(0).sym_eq(weights.sym_size(0)).sym_and(
                        up_weights->sym_size(1).sym_eq(weights.sym_size(1))),
                    "gated_linear_unit: the pair of weights must have one shape [K, N], got ", ShapeString(weights),
                    " and ", ShapeString(*up_weights));
    TORCH_CHECK(up_weights->scalar_type() == x.scalar_type(), "gated_linear_unit: weights must have x's dtype ",
                x.scalar_type(), ", got ", up_weights->scalar_type());
  } else {
    TORCH_CHECK(weights.dim() == 3 && weights.size(1) == 2,
                "gated_linear_unit: weights must be fused [K, 2, N] or a pair of [K, N], got shape ",
                ShapeString(weights));
  }
  TORCH_SYM_CHECK(weights.sym_size(0).sym_eq(k), "gated_linear_unit: weights must have K = x.shape[-1] = ", k,
                  " rows, got shape ", ShapeString(weights), " for x of shape ", ShapeString(x));
  TORCH_CHECK(weights.scalar_type() == x.scalar_type(), "gated_linear_unit: weights must have x's dtype ",
              x.scalar_type(), ", got ", weights.scalar_type());
  return configs;
}

Tensor GateOf(const Tensor& weights, const std::optional<Tensor>& up_weights) {
  return up_weights.has_value() ? weights : weights.select(1, 0);
}
Tensor UpOf(const Tensor& weights, const std::optional<Tensor>& up_weights) {
  return up_weights.has_value() ? *up_weights : weights.select(1, 1);
}

std::vector<c10::SymInt> LeadingSizes(const Tensor& x) {
  const auto sizes = x.sym_sizes();
  return std::vector<c10::SymInt>(sizes.begin(), sizes.end() - 1);
}

std::vector<c10::SymInt> Concat(std::vector<c10::SymInt> lead, std::initializer_list<c10::SymInt> tail) {
  lead.insert(lead.end(), tail.begin(), tail.end());
  return lead;
}

GatedLinearUnitShape ShapeOf(const Tensor& x, const Tensor& weights, const std::optional<Tensor>& up_weights) {
  GatedLinearUnitShape shape;
  shape.k = x.size(-1);
  shape.n = weights.size(-1);
  shape.m = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) shape.m *= x.size(d);
  shape.weights_in_place = ColumnsContiguous(weights) && (!up_weights || ColumnsContiguous(*up_weights));
  return shape;
}

// x's rows as [M, K]: a view when the leading dims merge, else a copy (documented in docs/ops.md).
Tensor Rows(const Tensor& t, const GatedLinearUnitShape& shape) { return t.reshape({shape.m, shape.k}); }

std::tuple<Tensor, Tensor> GluCpu(const Tensor& x, const Tensor& weights, const std::optional<Tensor>& up_weights,
                                  c10::string_view activation, bool return_residuals, at::OptionalIntArrayRef config,
                                  at::OptionalIntArrayRef bwd_config) {
  Activation act;
  const GluConfigs configs = CheckGluArgs(x, weights, up_weights, activation, config, bwd_config, &act);
  const GatedLinearUnitShape shape = ShapeOf(x, weights, up_weights);
  const Tensor rows = Rows(x, shape);
  Tensor out = NewOutput({shape.m, shape.n}, x.options());
  Tensor residuals = return_residuals ? NewOutput({shape.m, 2, shape.n}, x.options()) : at::empty({0}, x.options());
  GatedLinearUnitParams params;
  params.x = StridedViewOf<2>(rows, kOp);
  params.gate = StridedViewOf<2>(GateOf(weights, up_weights), kOp);
  params.up = StridedViewOf<2>(UpOf(weights, up_weights), kOp);
  params.activation = act;
  params.out = MutableStridedViewOf<2>(out, kOp);
  if (return_residuals) params.residuals = MutableStridedViewOf<3>(residuals, kOp);
  const GatedLinearUnitConfig resolved = ConfigOrHeuristic<&GatedLinearUnitHeuristicConfig>(
      configs.forward, shape, params.x.dtype, GatedLinearUnitProduct::kForward);
  const Status status = GatedLinearUnit(params, resolved);
  TORCH_CHECK(status.ok(), status.message());
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end() - 1);
  out_sizes.push_back(shape.n);
  out = out.view(out_sizes);
  if (return_residuals) {
    out_sizes.back() = 2;
    out_sizes.push_back(shape.n);
    residuals = residuals.view(out_sizes);
  }
  return {out, residuals};
}

std::tuple<Tensor, Tensor> GluMeta(const Tensor& x, const Tensor& weights, const std::optional<Tensor>& up_weights,
                                   c10::string_view activation, bool return_residuals,
                                   at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  CheckGluArgs(x, weights, up_weights, activation, config, bwd_config);
  const c10::SymInt n = weights.sym_size(-1);
  Tensor out = at::empty_symint(Concat(LeadingSizes(x), {n}), x.options());
  Tensor residuals = return_residuals ? at::empty_symint(Concat(LeadingSizes(x), {2, n}), x.options())
                                      : at::empty({0}, x.options());
  return {out, residuals};
}

// Plain ATen ops in fp32 (float64 for float64): autograd and shapes by decomposition.
std::tuple<Tensor, Tensor> GluReference(const Tensor& x, const Tensor& weights,
                                        const std::optional<Tensor>& up_weights, c10::string_view activation,
                                        bool return_residuals, at::OptionalIntArrayRef config,
                                        at::OptionalIntArrayRef bwd_config) {
  Activation act;
  CheckGluArgs(x, weights, up_weights, activation, config, bwd_config, &act);  // configs validated, not used
  const at::ScalarType wide = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor xw = x.to(wide);
  const Tensor gate = at::matmul(xw, GateOf(weights, up_weights).to(wide));
  const Tensor up = at::matmul(xw, UpOf(weights, up_weights).to(wide));
  Tensor activated;
  switch (act) {
    case Activation::kNone: activated = gate; break;
    case Activation::kRelu: activated = at::relu(gate); break;
    case Activation::kSilu: activated = at::silu(gate); break;
    case Activation::kGeluTanh: activated = at::gelu(gate, "tanh"); break;
    case Activation::kGeluErf: activated = at::gelu(gate); break;
    case Activation::kSigmoid: activated = at::sigmoid(gate); break;
  }
  Tensor out = (activated * up).to(x.scalar_type());
  Tensor residuals = return_residuals ? at::stack({gate, up}, -2).to(x.scalar_type()) : at::empty({0}, x.options());
  return {out, residuals};
}

// ---- the backward: a registered op of its own, so compiled graphs record it -------------------

// The weights as one [K, 2N] matrix (gate's columns, then up's): a view of a fused weight whose
// middle dim steps N columns, else a fused copy (a pair, or other strides: K x 2N elements).
Tensor MergedWeights(const Tensor& weights, const std::optional<Tensor>& up_weights) {
  const Tensor fused = up_weights.has_value() ? at::stack({weights, *up_weights}, 1) : weights;
  const int64_t k = fused.size(0), n = fused.size(2);
  if (fused.stride(1) == n * fused.stride(2) || n == 0) {
    return fused.as_strided({k, 2 * n}, {fused.stride(0), fused.stride(2)});
  }
  return fused.contiguous().view({k, 2 * n});
}

// `overwrite`: dpre is written over the residuals (the `_overwrite` op, whose schema says it
// mutates them), saving [M, 2N] elements; otherwise dpre is fresh working memory.
std::tuple<Tensor, Tensor> GluBackwardImpl(const Tensor& dout, const Tensor& x, const Tensor& weights,
                                           const std::optional<Tensor>& up_weights, const Tensor& residuals,
                                           c10::string_view activation, bool x_grad, bool weights_grad,
                                           at::OptionalIntArrayRef config, bool overwrite) {
  Activation act;
  const GluConfigs configs = CheckGluArgs(x, weights, up_weights, activation, config, std::nullopt, &act);
  const GatedLinearUnitShape shape = ShapeOf(x, weights, up_weights);
  const int64_t m = shape.m, k = shape.k, n = shape.n;
  TORCH_CHECK(dout.numel() == m * n && dout.scalar_type() == x.scalar_type(),
              "gated_linear_unit backward: dout must have the output's shape and x's dtype, got ", ShapeString(dout));
  TORCH_CHECK(residuals.numel() == m * 2 * n && residuals.scalar_type() == x.scalar_type(),
              "gated_linear_unit backward: residuals must be [..., M, 2, N] in x's dtype, got ",
              ShapeString(residuals));
  const Tensor rows = Rows(x, shape);
  const Tensor dout_rows = dout.reshape({m, n});
  const Tensor residual_rows = residuals.reshape({m, 2, n});
  Tensor dpre;
  if (overwrite && residual_rows.is_contiguous()) {
    dpre = residual_rows.view({m, 2 * n});  // (i, j) and (i, N + j) are residuals (i, 0, j) and (i, 1, j)
  } else {
    dpre = NewOutput({m, 2 * n}, x.options());
  }
  Tensor dx = x_grad ? NewOutput({m, k}, x.options()) : at::empty({0}, x.options());
  Tensor dweights = weights_grad ? NewOutput({k, 2, n}, x.options()) : at::empty({0}, x.options());
  const Tensor merged = x_grad ? MergedWeights(weights, up_weights) : Tensor();
  GatedLinearUnitBackwardParams params;
  params.dout = StridedViewOf<2>(dout_rows, kOp);
  params.x = StridedViewOf<2>(rows, kOp);
  if (x_grad) params.weights = StridedViewOf<2>(merged, kOp);
  params.residuals = StridedViewOf<3>(residual_rows, kOp);
  params.activation = act;
  params.dpre = MutableStridedViewOf<2>(dpre, kOp);
  if (x_grad) params.dx = MutableStridedViewOf<2>(dx, kOp);
  if (weights_grad) params.dweights = MutableStridedViewOf<2>(dweights.view({k, 2 * n}), kOp);
  const GatedLinearUnitConfig resolved = ConfigOrHeuristic<&GatedLinearUnitHeuristicConfig>(
      configs.forward, shape, params.x.dtype, GatedLinearUnitProduct::kBackward);
  const Status status = GatedLinearUnitBackward(params, resolved);
  TORCH_CHECK(status.ok(), status.message());
  return {x_grad ? dx.view(x.sizes()) : dx, dweights};
}

std::tuple<Tensor, Tensor> GluBackwardCpu(const Tensor& dout, const Tensor& x, const Tensor& weights,
                                          const std::optional<Tensor>& up_weights, const Tensor& residuals,
                                          c10::string_view activation, bool x_grad, bool weights_grad,
                                          at::OptionalIntArrayRef config) {
  return GluBackwardImpl(dout, x, weights, up_weights, residuals, activation, x_grad, weights_grad, config, false);
}

std::tuple<Tensor, Tensor> GluBackwardOverwriteCpu(const Tensor& dout, const Tensor& x, const Tensor& weights,
                                                   const std::optional<Tensor>& up_weights, const Tensor& residuals,
                                                   c10::string_view activation, bool x_grad, bool weights_grad,
                                                   at::OptionalIntArrayRef config) {
  return GluBackwardImpl(dout, x, weights, up_weights, residuals, activation, x_grad, weights_grad, config, true);
}

std::tuple<Tensor, Tensor> GluBackwardMeta(const Tensor& dout, const Tensor& x, const Tensor& weights,
                                           const std::optional<Tensor>& up_weights, const Tensor& residuals,
                                           c10::string_view activation, bool x_grad, bool weights_grad,
                                           at::OptionalIntArrayRef config) {
  CheckGluArgs(x, weights, up_weights, activation, config);
  Tensor dx = x_grad ? at::empty_symint(x.sym_sizes(), x.options()) : at::empty({0}, x.options());
  Tensor dweights = weights_grad ? at::empty_symint({weights.sym_size(0), 2, weights.sym_size(-1)}, x.options())
                                 : at::empty({0}, x.options());
  return {dx, dweights};
}

using ForwardSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                                    c10::string_view, bool, at::OptionalIntArrayRef,
                                                    at::OptionalIntArrayRef);
using BackwardSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                     const std::optional<Tensor>&, const Tensor&, c10::string_view,
                                                     bool, bool, at::OptionalIntArrayRef);

const c10::TypedOperatorHandle<ForwardSignature>& ForwardOp() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("tokamax::gated_linear_unit", "").typed<ForwardSignature>();
  return op;
}

// Saved for the backward: x, the weights and the residuals (both pre-activations, [..., M, 2, N]
// in x's dtype, written by the forward's store): the backward recomputes no product. When the
// graph is not kept (no retain_graph / create_graph), the residuals are not returned to the
// caller and nothing else holds their storage, the backward writes d(pre-activations) over them
// (the `_overwrite` op) instead of allocating [M, 2N] more: the engine frees the saved tensors
// after this backward anyway, and a second backward through the graph raises as usual.
class GluFunction : public torch::autograd::Function<GluFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weights,
                             const std::optional<Tensor>& up_weights, c10::string_view activation,
                             bool return_residuals, at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
    Tensor out, residuals;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out, residuals) =
          ForwardOp().call(x, weights, up_weights, activation, /*return_residuals=*/true, config, bwd_config);
    }
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["pair"] = up_weights.has_value();
    ctx->saved_data["returned"] = return_residuals;
    ctx->saved_data["bwd_config"] = bwd_config.has_value() ? bwd_config->vec() : std::vector<int64_t>{};
    ctx->save_for_backward({x, weights, up_weights.value_or(Tensor()), residuals});
    const Tensor returned = return_residuals ? residuals : at::empty({0}, x.options());
    return {out, returned};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("tokamax::_gated_linear_unit_backward", "")
                               .typed<BackwardSignature>();
    static const auto overwrite_op = c10::Dispatcher::singleton()
                                         .findSchemaOrThrow("tokamax::_gated_linear_unit_backward_overwrite", "")
                                         .typed<BackwardSignature>();
    auto saved = ctx->get_saved_variables();
    const bool pair = ctx->saved_data["pair"].toBool();
    const std::optional<Tensor> up = pair ? std::optional<Tensor>(saved[2]) : std::nullopt;
    const bool x_grad = ctx->needs_input_grad(0);
    const bool weights_grad = ctx->needs_input_grad(1) || (pair && ctx->needs_input_grad(2));
    const std::vector<int64_t> config = ctx->saved_data["bwd_config"].toIntVector();  // empty: heuristic
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const bool overwrite = !ctx->saved_data["returned"].toBool() &&
                           !torch::autograd::get_current_graph_task_keep_graph() && IsPlainCpu(saved[3]) &&
                           saved[3].storage().use_count() == 1;
    auto [dx, dweights] = (overwrite ? overwrite_op : op)
                              .call(grads[0], saved[0], saved[1], up, saved[3], activation, x_grad, weights_grad,
                                    config.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(config));
    saved.clear();
    tensor_list result(7);  // one per forward argument
    if (x_grad) result[0] = dx;
    if (weights_grad && pair) {
      result[1] = dweights.select(1, 0);
      result[2] = dweights.select(1, 1);
    } else if (weights_grad) {
      result[1] = dweights;
    }
    return result;
  }
};

std::tuple<Tensor, Tensor> GluAutograd(const Tensor& x, const Tensor& weights,
                                       const std::optional<Tensor>& up_weights, c10::string_view activation,
                                       bool return_residuals, at::OptionalIntArrayRef config,
                                       at::OptionalIntArrayRef bwd_config) {
  if (!NeedsAutogradFunction({&x, &weights}, {&up_weights})) {  // inference: no residuals unless asked for
    at::AutoDispatchBelowADInplaceOrView guard;
    return ForwardOp().call(x, weights, up_weights, activation, return_residuals, config, bwd_config);
  }
  if (auto reference = RunReferenceWhereFunctionCannot<std::tuple<Tensor, Tensor>>(
          kOp, x, weights, up_weights, activation, return_residuals, config, bwd_config)) {
    return *reference;
  }
  const tensor_list out =
      GluFunction::apply(x, weights, up_weights, activation, return_residuals, config, bwd_config);
  // The residuals are not differentiable: detached here rather than marked in the Function
  // (compiled autograd asserts that no C++ Function marks an output non-differentiable).
  return {out[0], out[1].detach()};
}

// The problem of the config helper ops (op_kit.h): the call's sizes and dtype.
ConfigProblem<GatedLinearUnitShape> GluConfigProblem(const Tensor& x, const Tensor& weights,
                                                     const std::optional<Tensor>& up_weights) {
  CheckGluArgs(x, weights, up_weights, "none");
  return {ShapeOf(x, weights, up_weights), ToCoreDType(x.scalar_type(), kOp)};
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_GLU_ARGS                                                                                     \
  "(Tensor x, Tensor weights, Tensor? up_weights=None, str activation=\"swish\", bool return_residuals=False, " \
  "int[]? config=None, int[]? bwd_config=None) -> (Tensor out, Tensor residuals)"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("gated_linear_unit" TOKAMAX_GLU_ARGS);
  m.def("gated_linear_unit_reference" TOKAMAX_GLU_ARGS);
  m.def("_gated_linear_unit_backward(Tensor dout, Tensor x, Tensor weights, Tensor? up_weights, Tensor residuals, "
        "str activation, bool x_grad, bool weights_grad, int[]? config=None) -> (Tensor dx, Tensor dweights)");
  // The same, d(pre-activations) written over `residuals` (the autograd backward's choice when
  // the graph is not kept): their contents after the call are unspecified.
  m.def("_gated_linear_unit_backward_overwrite(Tensor dout, Tensor x, Tensor weights, Tensor? up_weights, "
        "Tensor(a!) residuals, str activation, bool x_grad, bool weights_grad, int[]? config=None) -> "
        "(Tensor dx, Tensor dweights)");
  tokamax::DefineConfigOps<&tokamax::GluConfigProblem, &tokamax::GatedLinearUnitHeuristicConfig,
                           &tokamax::GatedLinearUnitConfigSpace>(m, "Tensor x, Tensor weights, Tensor? up_weights=None");
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("gated_linear_unit", &tokamax::GluCpu);
  m.impl("_gated_linear_unit_backward", &tokamax::GluBackwardCpu);
  m.impl("_gated_linear_unit_backward_overwrite", &tokamax::GluBackwardOverwriteCpu);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("gated_linear_unit", &tokamax::GluMeta);
  m.impl("_gated_linear_unit_backward", &tokamax::GluBackwardMeta);
  m.impl("_gated_linear_unit_backward_overwrite", &tokamax::GluBackwardMeta);
}

TORCH_LIBRARY_IMPL(tokamax, CompositeImplicitAutograd, m) {
  m.impl("gated_linear_unit_reference", &tokamax::GluReference);
}

TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("gated_linear_unit", &tokamax::GluAutograd);
}

TORCH_LIBRARY_IMPL(tokamax, AutocastCPU, m) {
  tokamax::RegisterLowerPrecisionAutocast(m, {"gated_linear_unit", "gated_linear_unit_reference"});
}
