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
// loss, lse and the folded gradients dx and dweights (for dloss = 1, in the accumulation type).
using TrainResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// The folded gradients' buffers: dx [B, H] and dweights with weights' layout (an nn.Linear
// weight's transposed view gets a transposed one), in the accumulation type; [0] where not wanted.
std::tuple<Tensor, Tensor> FoldedGradients(const Tensor& x, const Tensor& weights, bool x_grad, bool weights_grad) {
  const auto options = x.options().dtype(AccType(x));
  const Tensor none = at::empty({0}, options);
  return {x_grad ? NewOutputSymint(x.sym_sizes(), options) : none,
          weights_grad ? NewOutputLike(weights, options.dtype().toScalarType()) : none};
}

void CheckFoldable(c10::string_view reduction) {
  TORCH_CHECK(ParseReduction(reduction) != LossReduction::kNone, kOp,
              ": the forward with folded gradients needs reduction 'sum' or 'mean', got 'none'");
}

TrainResult LceForwardImpl(const Tensor& x, const Tensor& labels, const Tensor& weights, c10::string_view reduction,
                           int64_t ignore_index, std::optional<double> label_smoothing,
                           std::optional<double> z_loss_weight, std::optional<double> logits_soft_cap,
                           at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config, bool x_grad,
                           bool weights_grad) {
  const LceConfigs configs = CheckLceArgs(x, labels, weights, reduction, label_smoothing, z_loss_weight,
                                          logits_soft_cap, config, bwd_config);
  if (x_grad || weights_grad) CheckFoldable(reduction);
  const auto options = x.options().dtype(AccType(x));
  Tensor loss = ParseReduction(reduction) == LossReduction::kNone ? NewOutput({x.size(0)}, options)
                                                                  : NewOutput({}, options);
  Tensor lse = NewOutput({x.size(0)}, options);
  auto [dx, dweights] = FoldedGradients(x, weights, x_grad, weights_grad);
  Tensor labels64;
  LinearCrossEntropyParams params = ParamsOf(x, labels, weights, reduction, ignore_index, label_smoothing,
                                             z_loss_weight, logits_soft_cap, &labels64);
  params.loss = loss.data_ptr();
  params.lse = lse.data_ptr();
  if (x_grad) {
    params.dx = MutableStridedViewOf<2>(dx, kOp);
  }
  if (weights_grad) {
    params.dw = MutableStridedViewOf<2>(dweights, kOp);
  }
  const LinearCrossEntropyConfig resolved = ConfigOrHeuristic<&LinearCrossEntropyHeuristicConfig>(
      configs.forward, ShapeOf(x, weights), params.x.dtype, LinearCrossEntropyProduct::kForward);
  // The fold's gradient products are the backward's work: they run under its config.
  std::optional<LinearCrossEntropyConfig> gradient;
  if (x_grad || weights_grad) {
    gradient = ConfigOrHeuristic<&LinearCrossEntropyHeuristicConfig>(configs.backward, ShapeOf(x, weights),
                                                                      params.x.dtype,
                                                                      LinearCrossEntropyProduct::kBackward);
  }
  const Status status = LinearCrossEntropy(params, resolved, gradient ? &*gradient : nullptr);
  TORCH_CHECK(status.ok(), status.message());
  return {loss, lse, dx, dweights};
}

ForwardResult LceCpu(const Tensor& x, const Tensor& labels, const Tensor& weights, c10::string_view reduction,
                     int64_t ignore_index, std::optional<double> label_smoothing, std::optional<double> z_loss_weight,
                     std::optional<double> logits_soft_cap, at::OptionalIntArrayRef config,
                     at::OptionalIntArrayRef bwd_config) {
  auto [loss, lse, dx, dweights] = LceForwardImpl(x, labels, weights, reduction, ignore_index, label_smoothing,
                                                  z_loss_weight, logits_soft_cap, config, bwd_config, false, false);
  return {loss, lse};
}

// The forward with the gradient folded in (the autograd forward's choice for sum/mean when a
// gradient will be needed): three products instead of the forward's one and the backward's three.
TrainResult LceTrainCpu(const Tensor& x, const Tensor& labels, const Tensor& weights, c10::string_view reduction,
                        int64_t ignore_index, std::optional<double> label_smoothing,
                        std::optional<double> z_loss_weight, std::optional<double> logits_soft_cap, bool x_grad,
                        bool weights_grad, at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  CheckFoldable(reduction);
  return LceForwardImpl(x, labels, weights, reduction, ignore_index, label_smoothing, z_loss_weight, logits_soft_cap,
                        config, bwd_config, x_grad, weights_grad);
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

TrainResult LceTrainMeta(const Tensor& x, const Tensor& labels, const Tensor& weights, c10::string_view reduction,
                         int64_t ignore_index, std::optional<double> label_smoothing,
                         std::optional<double> z_loss_weight, std::optional<double> logits_soft_cap, bool x_grad,
                         bool weights_grad, at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  CheckFoldable(reduction);
  auto [loss, lse] = LceMeta(x, labels, weights, reduction, ignore_index, label_smoothing, z_loss_weight,
                             logits_soft_cap, config, bwd_config);
  auto [dx, dweights] = FoldedGradients(x, weights, x_grad, weights_grad);
  return {loss, lse, dx, dweights};
}

// The folded gradients times the loss's upstream gradient: out = dloss · folded in `dtype`, with
// folded's layout. Multiplying by the fp32 scalar adds one rounding (0.5 ulp of fp32) to each
// fp32 gradient, and none for dloss = 1.
void ScaleInto(const Tensor& dloss, const Tensor& folded, const Tensor& out) {
  TORCH_CHECK(dloss.numel() == 1, kOp, " backward: dloss must be a scalar for the folded gradients, got shape ",
              ShapeString(dloss));
  TORCH_CHECK(folded.scalar_type() == at::kFloat || folded.scalar_type() == at::kDouble, kOp,
              " backward: folded gradients must be float32 or float64, got ", folded.scalar_type());
  TORCH_CHECK(folded.is_non_overlapping_and_dense() && out.strides() == folded.strides(), kOp,
              " backward: folded gradients must be dense, got strides ", folded.strides());
  const double g = dloss.to(at::kDouble).item<double>();
  LinearCrossEntropyScale(folded.const_data_ptr(), ToCoreDType(folded.scalar_type(), kOp), g, out.data_ptr(),
                          ToCoreDType(out.scalar_type(), kOp), folded.numel());
}

Tensor LceScaleCpu(const Tensor& dloss, const Tensor& folded, at::ScalarType dtype) {
  Tensor out = NewOutputLike(folded, dtype);
  ScaleInto(dloss, folded, out);
  return out;
}

void LceScaleInPlaceCpu(const Tensor& dloss, const Tensor& folded) { ScaleInto(dloss, folded, folded); }

Tensor LceScaleMeta(const Tensor& dloss, const Tensor& folded, at::ScalarType dtype) {
  (void)dloss;
  return at::empty_like(folded, folded.options().dtype(dtype));
}

void LceScaleInPlaceMeta(const Tensor& dloss, const Tensor& folded) { (void)dloss, (void)folded; }

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
  // An ignored row picks an appended zero column (its label may be anything; V may be 0).
  const Tensor padded = at::cat({logits, at::zeros_symint({logits.sym_size(0), 1}, logits.options())}, 1);
  const Tensor safe = at::where(valid, labels.to(at::kLong), at::Scalar(logits.sym_size(1)));
  Tensor loss = lse - padded.gather(1, safe.unsqueeze(1)).squeeze(1);
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

using TrainSignature = TrainResult(const Tensor&, const Tensor&, const Tensor&, c10::string_view, int64_t,
                                   std::optional<double>, std::optional<double>, std::optional<double>, bool, bool,
                                   at::OptionalIntArrayRef, at::OptionalIntArrayRef);
using ScaleSignature = Tensor(const Tensor&, const Tensor&, at::ScalarType);
using ScaleInPlaceSignature = void(const Tensor&, const Tensor&);

// Saved for the backward: x, labels, weights and lse ([B] fp32): no logits. With `fold` (sum or
// mean, a gradient needed) the forward is the `_train` op and also saves the gradients for
// dloss = 1 (dx [B, H] and dweights [H, V] in fp32, float64 for float64): the backward then only
// scales them by dloss, in place when nothing else can see them (eager, graph not kept, fp32).
// A cotangent for lse (return_residuals) cannot be folded: that backward runs the unfolded
// backward op, and the forward's gradient work is lost.
class LceFunction : public torch::autograd::Function<LceFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& labels, const Tensor& weights,
                             c10::string_view reduction, int64_t ignore_index, std::optional<double> label_smoothing,
                             std::optional<double> z_loss_weight, std::optional<double> logits_soft_cap,
                             at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config, bool fold) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("tokamax::linear_softmax_cross_entropy_loss", "")
                               .typed<ForwardSignature>();
    static const auto train = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("tokamax::_linear_softmax_cross_entropy_loss_train", "")
                                  .typed<TrainSignature>();
    Tensor loss, lse, dx, dweights;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      if (fold) {
        std::tie(loss, lse, dx, dweights) =
            train.call(x, labels, weights, reduction, ignore_index, label_smoothing, z_loss_weight, logits_soft_cap,
                       x.requires_grad(), weights.requires_grad(), config, bwd_config);
      } else {
        std::tie(loss, lse) = op.call(x, labels, weights, reduction, ignore_index, label_smoothing, z_loss_weight,
                                      logits_soft_cap, config, bwd_config);
      }
    }
    ctx->saved_data["fold"] = fold;
    ctx->saved_data["x_folded"] = fold && x.requires_grad();
    ctx->saved_data["weights_folded"] = fold && weights.requires_grad();
    ctx->set_materialize_grads(false);  // an unused loss or lse has no cotangent
    ctx->saved_data["reduction"] = std::string(reduction);
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = OptionalDouble(label_smoothing);
    ctx->saved_data["z_loss_weight"] = OptionalDouble(z_loss_weight);
    ctx->saved_data["logits_soft_cap"] = OptionalDouble(logits_soft_cap);
    ctx->saved_data["bwd_config"] = bwd_config.has_value() ? bwd_config->vec() : std::vector<int64_t>{};
    ctx->save_for_backward({x, labels, weights, lse, dx, dweights});
    return {loss, lse};
  }

  // dloss · the folded gradient, in `dtype`: written over it where nothing else can see it.
  static Tensor Scale(const Tensor& dloss, Tensor& folded, at::ScalarType dtype) {
    static const auto scale = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("tokamax::_linear_softmax_cross_entropy_loss_scale", "")
                                  .typed<ScaleSignature>();
    static const auto scale_ = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("tokamax::_linear_softmax_cross_entropy_loss_scale_", "")
                                   .typed<ScaleInPlaceSignature>();
    if (folded.scalar_type() == dtype && !torch::autograd::get_current_graph_task_keep_graph() &&
        IsPlainCpu(folded) && IsPlainCpu(dloss) && folded.storage().use_count() == 1) {
      scale_.call(dloss, folded);
      return folded;
    }
    return scale.call(dloss, folded, dtype);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("tokamax::_linear_softmax_cross_entropy_loss_backward", "")
                               .typed<BackwardSignature>();
    auto saved = ctx->get_saved_variables();
    const bool x_grad = ctx->needs_input_grad(0), weights_grad = ctx->needs_input_grad(2);
    tensor_list result(11);  // one per forward argument
    if ((!grads[0].defined() && !grads[1].defined()) || (!x_grad && !weights_grad)) return result;
    if (ctx->saved_data["fold"].toBool() && grads[0].defined() && !grads[1].defined() &&
        (!x_grad || ctx->saved_data["x_folded"].toBool()) &&
        (!weights_grad || ctx->saved_data["weights_folded"].toBool())) {
      Tensor dx = saved[4], dweights = saved[5];
      const at::ScalarType x_dtype = saved[0].scalar_type(), weights_dtype = saved[2].scalar_type();
      saved.clear();  // the folded gradients' only other holder is the graph
      if (x_grad) result[0] = Scale(grads[0], dx, x_dtype);
      if (weights_grad) result[2] = Scale(grads[0], dweights, weights_dtype);
      return result;
    }
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
  // Fold the gradient into the forward when one will be needed and the loss is a scalar (a
  // per-row upstream gradient of 'none' is unknown until the backward), where the core's
  // heuristic says the fold pays for the dtype and tier (LinearCrossEntropyFolds: not bf16/fp16
  // on amx). A folded bf16/fp16 call holds fp32 dx and dweights until the backward scales them.
  Isa isa = Isa::kScalar;
  (void)ActiveIsa(&isa);  // an error here is the kernel's to report
  const bool folds = IsSupportedFloat(x.scalar_type()) && LinearCrossEntropyFolds(ToCoreDType(x.scalar_type(), kOp), isa);
  const bool fold = WillBackward({&x, &weights}) && ParseReduction(reduction) != LossReduction::kNone && folds;
  if (auto reference = RunReferenceWhereFunctionCannot<ForwardResult>(kOp, x, labels, weights, reduction, ignore_index,
                                                                  label_smoothing, z_loss_weight, logits_soft_cap,
                                                                  config, bwd_config)) {
    return *reference;
  }
  const tensor_list out = LceFunction::apply(x, labels, weights, reduction, ignore_index, label_smoothing,
                                             z_loss_weight, logits_soft_cap, config, bwd_config, fold);
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
  m.def("_linear_softmax_cross_entropy_loss_train(Tensor x, Tensor labels, Tensor weights, str reduction, "
        "int ignore_index, float? label_smoothing, float? z_loss_weight, float? logits_soft_cap, bool x_grad, "
        "bool weights_grad, int[]? config=None, int[]? bwd_config=None) -> (Tensor loss, Tensor lse, Tensor dx, "
        "Tensor dweights)");
  m.def("_linear_softmax_cross_entropy_loss_scale(Tensor dloss, Tensor folded, ScalarType dtype) -> Tensor");
  // The same written over `folded` (the autograd backward's choice when nothing else can see it).
  m.def("_linear_softmax_cross_entropy_loss_scale_(Tensor dloss, Tensor(a!) folded) -> ()");
  tokamax::DefineConfigOps<&tokamax::LceConfigProblem, &tokamax::LinearCrossEntropyHeuristicConfig,
                           &tokamax::LinearCrossEntropyConfigSpace>(m, "Tensor x, Tensor labels, Tensor weights");
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("linear_softmax_cross_entropy_loss", &tokamax::LceCpu);
  m.impl("_linear_softmax_cross_entropy_loss_backward", &tokamax::LceBackwardCpu);
  m.impl("_linear_softmax_cross_entropy_loss_train", &tokamax::LceTrainCpu);
  m.impl("_linear_softmax_cross_entropy_loss_scale", &tokamax::LceScaleCpu);
  m.impl("_linear_softmax_cross_entropy_loss_scale_", &tokamax::LceScaleInPlaceCpu);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("linear_softmax_cross_entropy_loss", &tokamax::LceMeta);
  m.impl("_linear_softmax_cross_entropy_loss_backward", &tokamax::LceBackwardMeta);
  m.impl("_linear_softmax_cross_entropy_loss_train", &tokamax::LceTrainMeta);
  m.impl("_linear_softmax_cross_entropy_loss_scale", &tokamax::LceScaleMeta);
  m.impl("_linear_softmax_cross_entropy_loss_scale_", &tokamax::LceScaleInPlaceMeta);
}

TORCH_LIBRARY_IMPL(tokamax, CompositeImplicitAutograd, m) {
  m.impl("linear_softmax_cross_entropy_loss_reference", &tokamax::LceReference);
}

TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("linear_softmax_cross_entropy_loss", &tokamax::LceAutograd);
}

TORCH_LIBRARY_IMPL(tokamax, AutocastCPU, m) {
  tokamax::RegisterLowerPrecisionAutocast(m, {"linear_softmax_cross_entropy_loss", "linear_softmax_cross_entropy_loss_reference"});
}
