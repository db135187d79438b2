// tokamax::linear_softmax_cross_entropy_loss and its reference: the schemas, the one argument
// check, the CPU kernel and its backward op, the ATen reference, Meta kernels, C++ autograd and
// the config helper ops.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "csrc/ops/linear_softmax_cross_entropy_loss/linear_softmax_cross_entropy_loss.h"
#include "csrc/torch/adapter_utils.h"
#include "csrc/torch/op_kit.h"

namespace tokamax {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

constexpr const char* kOp = "linear_softmax_cross_entropy_loss";

struct LceConfigs {
  std::optional<LinearCrossEntropyConfig> forward, backward;
};

LossReduction ParseReduction(c10::string_view reduction) {
  if (reduction == "sum") return LossReduction::kSum;
  if (reduction == "mean") return LossReduction::kMean;
  if (reduction == "none") return LossReduction::kNone;
  TORCH_CHECK(false, kOp, ": reduction must be 'sum', 'mean' or 'none', got '", std::string(reduction), "'");
}

// The one argument check: kernel, reference, Meta, autograd and the config ops all call it.
// Reads metadata only (SymInt-safe); the labels' values are checked by the kernel.
LceConfigs CheckLceArgs(const Tensor& x, const Tensor& labels, const Tensor& weights, c10::string_view reduction,
                        std::optional<double> label_smoothing, std::optional<double> z_loss_weight,
                        std::optional<double> logits_soft_cap, at::OptionalIntArrayRef config = std::nullopt,
                        at::OptionalIntArrayRef bwd_config = std::nullopt) {
  LceConfigs configs{ParseOptionalConfig<LinearCrossEntropyConfig>(config, "config"),
                     ParseOptionalConfig<LinearCrossEntropyConfig>(bwd_config, "bwd_config")};
  TORCH_CHECK(IsSupportedFloat(x.scalar_type()), kOp, ": x must be float32, bfloat16, float16 or float64, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2, kOp, ": x must be 2-D [B, H], got shape ", ShapeString(x));
  TORCH_CHECK(weights.dim() == 2, kOp, ": weights must be 2-D [H, V], got shape ", ShapeString(weights));
  TORCH_CHECK(weights.scalar_type() == x.scalar_type(), kOp, ": weights must have x's dtype ", x.scalar_type(),
              ", got ", weights.scalar_type());
  TORCH_SYM_CHECK(weights.sym_size(0).sym_eq(x.sym_size(1)), kOp, ": weights must be [H, V] with H = ",
                  x.sym_size(1), " (x's last dim), got shape ", ShapeString(weights));
  TORCH_CHECK(labels.scalar_type() == at::kLong || labels.scalar_type() == at::kInt, kOp,
              ": labels must be int64 or int32, got ", labels.scalar_type());
  TORCH_CHECK(labels.dim() == 1, kOp, ": labels must be 1-D [B], got shape ", ShapeString(labels));
  TORCH_SYM_CHECK(labels.sym_size(0).sym_eq(x.sym_size(0)), kOp, ": labels must have length B = ", x.sym_size(0),
                  " (x's rows), got shape ", ShapeString(labels));
  ParseReduction(reduction);
  const double smoothing = label_smoothing.value_or(0.0);
  TORCH_CHECK(smoothing >= 0.0 && smoothing <= 1.0, kOp, ": label_smoothing must be in [0, 1], got ", smoothing);
  TORCH_CHECK(z_loss_weight.value_or(0.0) >= 0.0, kOp, ": z_loss_weight must be >= 0, got ",
              z_loss_weight.value_or(0.0));
  TORCH_CHECK(!logits_soft_cap || *logits_soft_cap > 0.0, kOp, ": logits_soft_cap must be positive (or None), got ",
              logits_soft_cap.value_or(0.0));
  return configs;
}

at::ScalarType AccType(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

LinearCrossEntropyShape ShapeOf(const Tensor& x, const Tensor& weights) {
  return {x.size(0), x.size(1), weights.size(1)};
}

std::vector<c10::SymInt> LossSizes(const Tensor& x, c10::string_view reduction) {
  if (ParseReduction(reduction) == LossReduction::kNone) return {x.sym_size(0)};
  return {};
}

// The params shared by both passes; `labels64` keeps the int64 copy of int32 labels alive.
LinearCrossEntropyParams ParamsOf(const Tensor& x, const Tensor& labels, const Tensor& weights,
                                  c10::string_view reduction, int64_t ignore_index,
                                  std::optional<double> label_smoothing, std::optional<double> z_loss_weight,
                                  std::optional<double> logits_soft_cap, Tensor* labels64) {
  LinearCrossEntropyParams params;
  params.x = StridedViewOf<2>(x, kOp);
  params.w = StridedViewOf<2>(weights, kOp);
  *labels64 = labels.scalar_type() == at::kLong ? labels : labels.to(at::kLong);
  params.labels = labels64->const_data_ptr<int64_t>();
  params.labels_stride = labels64->stride(0);
  params.reduction = ParseReduction(reduction);
  params.ignore_index = ignore_index;
  params.label_smoothing = label_smoothing.value_or(0.0);
  params.z_loss_weight = z_loss_weight.value_or(0.0);
  params.logits_soft_cap = logits_soft_cap.value_or(0.0);
  return params;
}

using ForwardResult = std::tuple<Tensor, Tensor>;

ForwardResult LceCpu(const Tensor& x, const Tensor& labels, const Tensor& weights, c10::string_view reduction,
                     int64_t ignore_index, std::optional<double> label_smoothing, std::optional<double> z_loss_weight,
                     std::optional<double> logits_soft_cap, at::OptionalIntArrayRef config,
                     at::OptionalIntArrayRef bwd_config) {
  const LceConfigs configs = CheckLceArgs(x, labels, weights, reduction, label_smoothing, z_loss_weight,
                                          logits_soft_cap, config, bwd_config);
  const auto options = x.options().dtype(AccType(x));
  Tensor loss = ParseReduction(reduction) == LossReduction::kNone ? NewOutput({x.size(0)}, options)
                                                                  : NewOutput({}, options);
  Tensor lse = NewOutput({x.size(0)}, options);
  Tensor labels64;
  LinearCrossEntropyParams params = ParamsOf(x, labels, weights, reduction, ignore_index, label_smoothing,
                                             z_loss_weight, logits_soft_cap, &labels64);
  params.loss = loss.data_ptr();
  params.lse = lse.data_ptr();
  const LinearCrossEntropyConfig resolved = ConfigOrHeuristic<&LinearCrossEntropyHeuristicConfig>(
      configs.forward, ShapeOf(x, weights), params.x.dtype, LinearCrossEntropyProduct::kForward);
  const Status status = LinearCrossEntropy(params, resolved);
  TORCH_CHECK(status.ok(), status.message());
  return {loss, lse};
}

ForwardResult LceMeta(const Tensor& x, const Tensor& labels, const Tensor& weights, c10::string_view reduction,
                      int64_t ignore_index, std::optional<double> label_smoothing, std::optional<double> z_loss_weight,
                      std::optional<double> logits_soft_cap, at::OptionalIntArrayRef config,
                      at::OptionalIntArrayRef bwd_config) {
  (void)ignore_index;
  CheckLceArgs(x, labels, weights, reduction, label_smoothing, z_loss_weight, logits_soft_cap, config, bwd_config);
  const auto options = x.options().dtype(AccType(x));
  return {at::empty_symint(LossSizes(x, reduction), options), at::empty_symint({x.sym_size(0)}, options)};
}

// Plain ATen ops in fp32 (float64 for float64), materialising the [B, V] logits: autograd and
// shapes by decomposition.
ForwardResult LceReference(const Tensor& x, const Tensor& labels, const Tensor& weights, c10::string_view reduction,
                           int64_t ignore_index, std::optional<double> label_smoothing,
                           std::optional<double> z_loss_weight, std::optional<double> logits_soft_cap,
                           at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  CheckLceArgs(x, labels, weights, reduction, label_smoothing, z_loss_weight, logits_soft_cap, config,
               bwd_config);  // configs: validated only
  const at::ScalarType acc = AccType(x);
  Tensor logits = at::matmul(x.to(acc), weights.to(acc));
  if (logits_soft_cap) logits = at::tanh(logits / *logits_soft_cap) * *logits_soft_cap;
  const Tensor lse = at::logsumexp(logits, {-1});
  const Tensor valid = labels.ne(ignore_index);
  const Tensor safe = at::where(valid, labels, at::zeros_like(labels)).to(at::kLong);
  Tensor loss = lse - logits.gather(1, safe.unsqueeze(1)).squeeze(1);
  const double smoothing = label_smoothing.value_or(0.0);
  if (smoothing != 0.0) loss = loss * (1.0 - smoothing) + (lse - logits.mean(-1)) * smoothing;
  if (z_loss_weight.value_or(0.0) != 0.0) loss = loss + lse * lse * *z_loss_weight;
  loss = at::where(valid, loss, at::zeros_like(loss));
  switch (ParseReduction(reduction)) {
    case LossReduction::kSum: return {loss.sum(), lse};
    case LossReduction::kMean: return {loss.sum() / valid.sum().clamp_min(1).to(acc), lse};
    case LossReduction::kNone: break;
  }
  return {loss, lse};
}

// ---- the backward op -----------------------------------------------------------------------

using BackwardResult = std::tuple<Tensor, Tensor>;

void CheckLceBackwardArgs(const std::optional<Tensor>& dloss, const std::optional<Tensor>& dlse, const Tensor& x,
                          const Tensor& lse, c10::string_view reduction) {
  const std::vector<c10::SymInt> loss_sizes = LossSizes(x, reduction);
  if (dloss.has_value()) {
    TORCH_CHECK(dloss->dim() == static_cast<int64_t>(loss_sizes.size()), kOp,
                " backward: dloss must have the loss's shape, got ", ShapeString(*dloss));
    if (!loss_sizes.empty()) {
      TORCH_SYM_CHECK(dloss->sym_size(0).sym_eq(loss_sizes[0]), kOp, " backward: dloss must be [B], got ",
                      ShapeString(*dloss));
    }
  }
  for (const Tensor* t : {&lse, dlse.has_value() ? &*dlse : nullptr}) {
    if (t == nullptr) continue;
    TORCH_CHECK(t->dim() == 1, kOp, " backward: lse and dlse must be [B], got ", ShapeString(*t));
    TORCH_SYM_CHECK(t->sym_size(0).sym_eq(x.sym_size(0)), kOp, " backward: lse and dlse must be [B], got ",
                    ShapeString(*t));
  }
}

BackwardResult EmptyGradients(const Tensor& x, const Tensor& weights, bool x_grad, bool weights_grad) {
  const Tensor none = at::empty({0}, x.options());
  // dweights has weights' layout (an nn.Linear weight's transposed view gets a transposed view).
  return {x_grad ? NewOutputSymint(x.sym_sizes(), x.options()) : none,
          weights_grad ? NewOutputLike(weights) : none};
}

BackwardResult LceBackwardCpu(const std::optional<Tensor>& dloss, const std::optional<Tensor>& dlse, const Tensor& x,
                              const Tensor& labels, const Tensor& weights, const Tensor& lse,
                              c10::string_view reduction, int64_t ignore_index, std::optional<double> label_smoothing,
                              std::optional<double> z_loss_weight, std::optional<double> logits_soft_cap, bool x_grad,
                              bool weights_grad, at::OptionalIntArrayRef config) {
  const LceConfigs configs =
      CheckLceArgs(x, labels, weights, reduction, label_smoothing, z_loss_weight, logits_soft_cap, config);
  CheckLceBackwardArgs(dloss, dlse, x, lse, reduction);
  auto [dx, dweights] = EmptyGradients(x, weights, x_grad, weights_grad);
  Tensor labels64;
  LinearCrossEntropyParams params = ParamsOf(x, labels, weights, reduction, ignore_index, label_smoothing,
                                             z_loss_weight, logits_soft_cap, &labels64);
  const at::ScalarType acc = AccType(x);
  const Tensor lse_c = lse.to(acc).contiguous();
  const Tensor dloss_c = dloss.has_value() ? dloss->to(acc).contiguous() : Tensor();
  const Tensor dlse_c = dlse.has_value() ? dlse->to(acc).contiguous() : Tensor();
  params.lse = const_cast<void*>(lse_c.const_data_ptr());
  params.dloss = dloss_c.defined() ? dloss_c.const_data_ptr() : nullptr;
  params.dlse = dlse_c.defined() ? dlse_c.const_data_ptr() : nullptr;
  if (x_grad) params.dx = MutableStridedViewOf<2>(dx, kOp);
  if (weights_grad) params.dw = MutableStridedViewOf<2>(dweights, kOp);
  const LinearCrossEntropyConfig resolved = ConfigOrHeuristic<&LinearCrossEntropyHeuristicConfig>(
      configs.forward, ShapeOf(x, weights), params.x.dtype, LinearCrossEntropyProduct::kBackward);
  const Status status = LinearCrossEntropyBackward(params, resolved);
  TORCH_CHECK(status.ok(), status.message());
  return {dx, dweights};
}

BackwardResult LceBackwardMeta(const std::optional<Tensor>& dloss, const std::optional<Tensor>& dlse, const Tensor& x,
                               const Tensor& labels, const Tensor& weights, const Tensor& lse,
                               c10::string_view reduction, int64_t ignore_index, std::optional<double> label_smoothing,
                               std::optional<double> z_loss_weight, std::optional<double> logits_soft_cap, bool x_grad,
                               bool weights_grad, at::OptionalIntArrayRef config) {
  (void)ignore_index;
  CheckLceArgs(x, labels, weights, reduction, label_smoothing, z_loss_weight, logits_soft_cap, config);
  CheckLceBackwardArgs(dloss, dlse, x, lse, reduction);
  return EmptyGradients(x, weights, x_grad, weights_grad);
}

// ---- autograd: the backward is a registered op of its own, so compiled graphs record it ----------

using ForwardSignature = ForwardResult(const Tensor&, const Tensor&, const Tensor&, c10::string_view, int64_t,
                                       std::optional<double>, std::optional<double>, std::optional<double>,
                                       at::OptionalIntArrayRef, at::OptionalIntArrayRef);
using BackwardSignature = BackwardResult(const std::optional<Tensor>&, const std::optional<Tensor>&, const Tensor&,
                                         const Tensor&, const Tensor&, const Tensor&, c10::string_view, int64_t,
                                         std::optional<double>, std::optional<double>, std::optional<double>, bool,
                                         bool, at::OptionalIntArrayRef);

std::optional<Tensor> Optional(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }
c10::IValue OptionalDouble(std::optional<double> v) { return v ? c10::IValue(*v) : c10::IValue(); }

// Saved for the backward: x, labels, weights and lse ([B] fp32): no logits.
class LceFunction : public torch::autograd::Function<LceFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& labels, const Tensor& weights,
                             c10::string_view reduction, int64_t ignore_index, std::optional<double> label_smoothing,
                             std::optional<double> z_loss_weight, std::optional<double> logits_soft_cap,
                             at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("tokamax::linear_softmax_cross_entropy_loss", "")
                               .typed<ForwardSignature>();
    Tensor loss, lse;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(loss, lse) = op.call(x, labels, weights, reduction, ignore_index, label_smoothing, z_loss_weight,
                                    logits_soft_cap, config, bwd_config);
    }
    ctx->set_materialize_grads(false);  // an unused loss or lse has no cotangent
    ctx->saved_data["reduction"] = std::string(reduction);
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = OptionalDouble(label_smoothing);
    ctx->saved_data["z_loss_weight"] = OptionalDouble(z_loss_weight);
    ctx->saved_data["logits_soft_cap"] = OptionalDouble(logits_soft_cap);
    ctx->saved_data["bwd_config"] = bwd_config.has_value() ? bwd_config->vec() : std::vector<int64_t>{};
    ctx->save_for_backward({x, labels, weights, lse});
    return {loss, lse};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("tokamax::_linear_softmax_cross_entropy_loss_backward", "")
                               .typed<BackwardSignature>();
    const auto saved = ctx->get_saved_variables();
    const bool x_grad = ctx->needs_input_grad(0), weights_grad = ctx->needs_input_grad(2);
    tensor_list result(10);  // one per forward argument
    if ((!grads[0].defined() && !grads[1].defined()) || (!x_grad && !weights_grad)) return result;
    const std::vector<int64_t> config = ctx->saved_data["bwd_config"].toIntVector();  // empty: heuristic
    const std::string reduction = ctx->saved_data["reduction"].toStringRef();
    auto [dx, dweights] = op.call(Optional(grads[0]), Optional(grads[1]), saved[0], saved[1], saved[2], saved[3],
                                  reduction, ctx->saved_data["ignore_index"].toInt(),
                                  ctx->saved_data["label_smoothing"].toOptional<double>(),
                                  ctx->saved_data["z_loss_weight"].toOptional<double>(),
                                  ctx->saved_data["logits_soft_cap"].toOptional<double>(), x_grad, weights_grad,
                                  config.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(config));
    if (x_grad) result[0] = dx;
    if (weights_grad) result[2] = dweights;
    return result;
  }
};

ForwardResult LceAutograd(const Tensor& x, const Tensor& labels, const Tensor& weights, c10::string_view reduction,
                          int64_t ignore_index, std::optional<double> label_smoothing,
                          std::optional<double> z_loss_weight, std::optional<double> logits_soft_cap,
                          at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  const tensor_list out = LceFunction::apply(x, labels, weights, reduction, ignore_index, label_smoothing,
                                             z_loss_weight, logits_soft_cap, config, bwd_config);
  return {out[0], out[1]};
}

// The problem of the config helper ops (op_kit.h): the call's B, H, V and dtype.
ConfigProblem<LinearCrossEntropyShape> LceConfigProblem(const Tensor& x, const Tensor& labels, const Tensor& weights) {
  CheckLceArgs(x, labels, weights, "sum", std::nullopt, std::nullopt, std::nullopt);
  return {ShapeOf(x, weights), ToCoreDType(x.scalar_type(), kOp)};
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_LCE_ARGS                                                                                      \
  "(Tensor x, Tensor labels, Tensor weights, str reduction=\"sum\", int ignore_index=-100, "                  \
  "float? label_smoothing=None, float? z_loss_weight=None, float? logits_soft_cap=None, int[]? config=None, " \
  "int[]? bwd_config=None) -> (Tensor loss, Tensor lse)"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("linear_softmax_cross_entropy_loss" TOKAMAX_LCE_ARGS);
  m.def("linear_softmax_cross_entropy_loss_reference" TOKAMAX_LCE_ARGS);
  m.def("_linear_softmax_cross_entropy_loss_backward(Tensor? dloss, Tensor? dlse, Tensor x, Tensor labels, "
        "Tensor weights, Tensor lse, str reduction, int ignore_index, float? label_smoothing, float? z_loss_weight, "
        "float? logits_soft_cap, bool x_grad, bool weights_grad, int[]? config=None) -> (Tensor dx, Tensor dweights)");
  tokamax::DefineConfigOps<&tokamax::LceConfigProblem, &tokamax::LinearCrossEntropyHeuristicConfig,
                           &tokamax::LinearCrossEntropyConfigSpace>(m, "Tensor x, Tensor labels, Tensor weights");
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("linear_softmax_cross_entropy_loss", &tokamax::LceCpu);
  m.impl("_linear_softmax_cross_entropy_loss_backward", &tokamax::LceBackwardCpu);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("linear_softmax_cross_entropy_loss", &tokamax::LceMeta);
  m.impl("_linear_softmax_cross_entropy_loss_backward", &tokamax::LceBackwardMeta);
}

TORCH_LIBRARY_IMPL(tokamax, CompositeImplicitAutograd, m) {
  m.impl("linear_softmax_cross_entropy_loss_reference", &tokamax::LceReference);
}

TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("linear_softmax_cross_entropy_loss", &tokamax::LceAutograd);
}
