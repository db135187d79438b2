// tokamax::layer_norm and its reference: the schemas, the one argument check, the CPU kernel and
// its backward op, the ATen reference, Meta kernels, C++ autograd and the config helper ops.
// rms_norm is layer_norm with subtract_mean=False (one op, one kernel).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "csrc/ops/layer_norm/layer_norm.h"
#include "csrc/torch/adapter_utils.h"
#include "csrc/torch/op_kit.h"

namespace tokamax {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

constexpr const char* kOp = "layer_norm";
// None defaults (see docs/adding_an_op.md, "What not to copy"): float defaults would be traced
// as symbolic floats under dynamic shapes.
constexpr double kDefaultEpsilon = 1e-6;

struct LayerNormConfigs {
  std::optional<LayerNormConfig> forward, backward;
};

// The one argument check: kernel, reference, Meta, autograd and the config ops all call it.
// Reads metadata only (SymInt-safe).
LayerNormConfigs CheckLayerNormArgs(const Tensor& x, const std::optional<Tensor>& scale,
                                    const std::optional<Tensor>& offset, const std::optional<Tensor>& residual,
                                    int64_t axis, std::optional<double> epsilon,
                                    at::OptionalIntArrayRef config = std::nullopt,
                                    at::OptionalIntArrayRef bwd_config = std::nullopt) {
  LayerNormConfigs configs{ParseOptionalConfig<LayerNormConfig>(config, "config"),
                           ParseOptionalConfig<LayerNormConfig>(bwd_config, "bwd_config")};
  TORCH_CHECK(IsSupportedFloat(x.scalar_type()),
              "layer_norm: x must be float32, bfloat16, float16 or float64, got ", x.scalar_type());
  const int64_t rank = x.dim();
  TORCH_CHECK(rank >= 1, "layer_norm: x must have at least 1 dim, got shape ", ShapeString(x));
  TORCH_CHECK(axis >= -rank && axis < rank, "layer_norm: axis must be in [", -rank, ", ", rank, ") for a ", rank,
              "-D x, got ", axis);
  TORCH_CHECK(axis == -1 || axis == rank - 1, "layer_norm: axis must be the last axis (-1 or ", rank - 1,
              "); other axes are not supported (move the axis last), got ", axis);
  TORCH_CHECK(!epsilon || *epsilon > 0, "layer_norm: epsilon must be positive, got ", epsilon.value_or(0));
  const c10::SymInt& cols = x.sym_size(-1);
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<Tensor>*>{"scale", &scale},
                                {"offset", &offset}}) {
    if (!t->has_value()) continue;
    const Tensor& v = **t;
    TORCH_CHECK(v.dim() == 1, "layer_norm: ", name, " must be 1-D [", cols, "] (the normalised axis), got shape ",
                ShapeString(v));
    TORCH_SYM_CHECK(v.sym_size(0).sym_eq(cols), "layer_norm: ", name, " must have length ", cols,
                    " (x's last axis), got shape ", ShapeString(v));
    TORCH_CHECK(v.scalar_type() == at::kFloat || v.scalar_type() == x.scalar_type(), "layer_norm: ", name,
                " must be float32 or x's dtype ", x.scalar_type(), ", got ", v.scalar_type());
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == rank, "layer_norm: residual must have x's shape ", ShapeString(x), ", got ",
                ShapeString(*residual));
    for (int64_t d = 0; d < rank; ++d) {
      TORCH_SYM_CHECK(residual->sym_size(d).sym_eq(x.sym_size(d)), "layer_norm: residual must have x's shape ",
                      ShapeString(x), ", got ", ShapeString(*residual));
    }
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), "layer_norm: residual must have x's dtype ",
                x.scalar_type(), ", got ", residual->scalar_type());
  }
  return configs;
}

at::ScalarType StatsType(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

std::vector<c10::SymInt> LeadingSizes(const Tensor& x) {
  const auto sizes = x.sym_sizes();
  return std::vector<c10::SymInt>(sizes.begin(), sizes.end() - 1);
}

LayerNormShape ShapeOf(const Tensor& x) {
  LayerNormShape shape;
  shape.cols = x.size(-1);
  shape.rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) shape.rows *= x.size(d);
  return shape;
}

// The core's row view of a tensor of x's shape: the last axis contiguous (a copy when it is not:
// documented in docs/ops.md), leading dims with any strides; more than kLayerNormMaxRank dims
// are reshaped to [rows, cols] first. Returns the tensor the view points into (keep it alive).
Tensor RowsOf(const Tensor& t, LayerNormRows* view, int* rank) {
  Tensor rows = t;
  if (rows.dim() > kLayerNormMaxRank) rows = rows.reshape({-1, rows.size(-1)});
  if (rows.size(-1) > 1 && rows.stride(-1) != 1) rows = rows.contiguous();
  *view = StridedViewOf<kLayerNormMaxRank>(rows, kOp);
  view->strides[rows.dim() - 1] = 1;  // a last axis of size 1 may have any stride
  *rank = static_cast<int>(rows.dim());
  return rows;
}

StridedView<1> VectorOf(const std::optional<Tensor>& t) {
  return t.has_value() ? StridedViewOf<1>(*t, kOp) : StridedView<1>{};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> LayerNormCpu(const Tensor& x, const std::optional<Tensor>& scale,
                                                        const std::optional<Tensor>& offset,
                                                        const std::optional<Tensor>& residual, int64_t axis,
                                                        std::optional<double> epsilon,
                                                        std::optional<double> scale_offset, bool subtract_mean,
                                                        at::OptionalIntArrayRef config,
                                                        at::OptionalIntArrayRef bwd_config) {
  const LayerNormConfigs configs = CheckLayerNormArgs(x, scale, offset, residual, axis, epsilon, config, bwd_config);
  const LayerNormShape shape = ShapeOf(x);
  Tensor y = NewOutput(x.sizes(), x.options());
  Tensor h = residual.has_value() ? NewOutput(x.sizes(), x.options()) : at::empty({0}, x.options());
  const auto lead = x.sizes().slice(0, x.dim() - 1);
  Tensor mean = NewOutput(lead, x.options().dtype(StatsType(x)));
  Tensor rstd = NewOutput(lead, x.options().dtype(StatsType(x)));
  LayerNormParams params;
  params.rows = shape.rows;
  params.cols = shape.cols;
  const Tensor x_rows = RowsOf(x, &params.x, &params.rank);
  Tensor residual_rows;
  if (residual.has_value()) {
    int rank = 0;
    residual_rows = RowsOf(*residual, &params.residual, &rank);
  }
  params.scale = VectorOf(scale);
  params.offset = VectorOf(offset);
  params.y = y.data_ptr();
  params.h = residual.has_value() ? h.data_ptr() : nullptr;
  params.mean = mean.data_ptr();
  params.rstd = rstd.data_ptr();
  params.epsilon = epsilon.value_or(kDefaultEpsilon);
  params.scale_offset = scale_offset.value_or(0.0);
  params.subtract_mean = subtract_mean;
  const LayerNormConfig resolved = ConfigOrHeuristic<&LayerNormHeuristicConfig>(
      configs.forward, shape, params.x.dtype, LayerNormProduct::kForward);
  const Status status = LayerNorm(params, resolved);
  TORCH_CHECK(status.ok(), status.message());
  return {y, h, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> LayerNormMeta(const Tensor& x, const std::optional<Tensor>& scale,
                                                         const std::optional<Tensor>& offset,
                                                         const std::optional<Tensor>& residual, int64_t axis,
                                                         std::optional<double> epsilon,
                                                         std::optional<double> scale_offset, bool subtract_mean,
                                                         at::OptionalIntArrayRef config,
                                                         at::OptionalIntArrayRef bwd_config) {
  (void)scale_offset, (void)subtract_mean;
  CheckLayerNormArgs(x, scale, offset, residual, axis, epsilon, config, bwd_config);
  Tensor y = at::empty_symint(x.sym_sizes(), x.options());
  Tensor h = residual.has_value() ? at::empty_symint(x.sym_sizes(), x.options()) : at::empty({0}, x.options());
  Tensor mean = at::empty_symint(LeadingSizes(x), x.options().dtype(StatsType(x)));
  Tensor rstd = at::empty_symint(LeadingSizes(x), x.options().dtype(StatsType(x)));
  return {y, h, mean, rstd};
}

// Plain ATen ops in fp32 (float64 for float64): autograd and shapes by decomposition.
std::tuple<Tensor, Tensor, Tensor, Tensor> LayerNormAtenReference(
    const Tensor& x, const std::optional<Tensor>& scale, const std::optional<Tensor>& offset,
    const std::optional<Tensor>& residual, int64_t axis, std::optional<double> epsilon,
    std::optional<double> scale_offset, bool subtract_mean, at::OptionalIntArrayRef config,
    at::OptionalIntArrayRef bwd_config) {
  CheckLayerNormArgs(x, scale, offset, residual, axis, epsilon, config, bwd_config);  // configs: validated only
  const at::ScalarType acc = StatsType(x);
  Tensor h = at::empty({0}, x.options());
  Tensor wide = x.to(acc);
  if (residual.has_value()) {
    h = (wide + residual->to(acc)).to(x.scalar_type());  // stored in x's dtype; that h is normalised
    wide = h.to(acc);
  }
  Tensor mean = subtract_mean ? wide.mean(-1) : at::zeros_symint(LeadingSizes(x), x.options().dtype(acc));
  const Tensor centred = subtract_mean ? wide - mean.unsqueeze(-1) : wide;
  const Tensor rstd = at::rsqrt(centred.pow(2).mean(-1) + epsilon.value_or(kDefaultEpsilon));
  Tensor y = centred * rstd.unsqueeze(-1);
  if (scale.has_value()) y = y * (scale->to(acc) + scale_offset.value_or(0.0));
  if (offset.has_value()) y = y + offset->to(acc);
  return {y.to(x.scalar_type()), h, mean, rstd};
}

// ---- the backward op -----------------------------------------------------------------------

void CheckLayerNormBackwardArgs(const Tensor& dy, const std::optional<Tensor>& dh, const Tensor& x,
                                const Tensor& mean, const Tensor& rstd) {
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"dy", &dy}, {"dh", dh ? &*dh : nullptr}}) {
    if (t == nullptr) continue;
    TORCH_CHECK(t->dim() == x.dim() && t->scalar_type() == x.scalar_type(), "layer_norm backward: ", name,
                " must be ", x.scalar_type(), ShapeString(x), ", got ", t->scalar_type(), ShapeString(*t));
    for (int64_t d = 0; d < x.dim(); ++d) {
      TORCH_SYM_CHECK(t->sym_size(d).sym_eq(x.sym_size(d)), "layer_norm backward: ", name, " must have shape ",
                      ShapeString(x), ", got ", ShapeString(*t));
    }
  }
  for (const Tensor* t : {&mean, &rstd}) {
    TORCH_CHECK(t->scalar_type() == StatsType(x) && t->dim() == x.dim() - 1,
                "layer_norm backward: mean and rstd must be ", StatsType(x), " of x's leading shape, got ",
                t->scalar_type(), ShapeString(*t));
  }
}

using BackwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;

BackwardResult EmptyGradients(const Tensor& x, const std::optional<Tensor>& scale,
                              const std::optional<Tensor>& offset, bool scale_grad, bool offset_grad,
                              bool residual_grad) {
  const Tensor none = at::empty({0}, x.options());
  return {NewOutputSymint(x.sym_sizes(), x.options()),
          residual_grad ? NewOutputSymint(x.sym_sizes(), x.options()) : none,
          scale_grad && scale ? NewOutputSymint(scale->sym_sizes(), scale->options()) : none,
          offset_grad && offset ? NewOutputSymint(offset->sym_sizes(), offset->options()) : none};
}

// `x` is the normalised input (h when a residual was added); `config` is the call's bwd_config.
BackwardResult LayerNormBackwardCpu(const Tensor& dy, const std::optional<Tensor>& dh, const Tensor& x,
                                    const Tensor& mean, const Tensor& rstd, const std::optional<Tensor>& scale,
                                    const std::optional<Tensor>& offset, std::optional<double> scale_offset,
                                    bool subtract_mean, bool scale_grad, bool offset_grad, bool residual_grad,
                                    at::OptionalIntArrayRef config) {
  const LayerNormConfigs configs = CheckLayerNormArgs(x, scale, offset, std::nullopt, -1, std::nullopt, config);
  CheckLayerNormBackwardArgs(dy, dh, x, mean, rstd);
  auto [dx, dresidual, dscale, doffset] = EmptyGradients(x, scale, offset, scale_grad, offset_grad, residual_grad);
  const LayerNormShape shape = ShapeOf(x);
  LayerNormParams params;
  params.rows = shape.rows;
  params.cols = shape.cols;
  int rank = 0;
  const Tensor x_rows = RowsOf(x, &params.x, &params.rank);
  const Tensor dy_rows = RowsOf(dy, &params.dy, &rank);
  Tensor dh_rows;
  if (dh.has_value()) dh_rows = RowsOf(*dh, &params.dh, &rank);
  const Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  params.scale = VectorOf(scale);
  params.offset = VectorOf(offset);
  params.y = dx.data_ptr();
  params.h = residual_grad ? dresidual.data_ptr() : nullptr;
  params.mean = const_cast<void*>(mean_c.const_data_ptr());
  params.rstd = const_cast<void*>(rstd_c.const_data_ptr());
  params.dscale = scale_grad && scale ? dscale.data_ptr() : nullptr;
  params.doffset = offset_grad && offset ? doffset.data_ptr() : nullptr;
  params.scale_offset = scale_offset.value_or(0.0);
  params.subtract_mean = subtract_mean;
  const LayerNormConfig resolved = ConfigOrHeuristic<&LayerNormHeuristicConfig>(
      configs.forward, shape, params.x.dtype, LayerNormProduct::kBackward);
  const Status status = LayerNormBackward(params, resolved);
  TORCH_CHECK(status.ok(), status.message());
  return {dx, dresidual, dscale, doffset};
}

BackwardResult LayerNormBackwardMeta(const Tensor& dy, const std::optional<Tensor>& dh, const Tensor& x,
                                     const Tensor& mean, const Tensor& rstd, const std::optional<Tensor>& scale,
                                     const std::optional<Tensor>& offset, std::optional<double> scale_offset,
                                     bool subtract_mean, bool scale_grad, bool offset_grad, bool residual_grad,
                                     at::OptionalIntArrayRef config) {
  (void)scale_offset, (void)subtract_mean;
  CheckLayerNormArgs(x, scale, offset, std::nullopt, -1, std::nullopt, config);
  CheckLayerNormBackwardArgs(dy, dh, x, mean, rstd);
  return EmptyGradients(x, scale, offset, scale_grad, offset_grad, residual_grad);
}

// ---- autograd: the backward is a registered op of its own, so compiled graphs record it ----------

using ForwardSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&, const std::optional<Tensor>&, int64_t,
    std::optional<double>, std::optional<double>, bool, at::OptionalIntArrayRef, at::OptionalIntArrayRef);
using BackwardSignature = BackwardResult(const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&,
                                         const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
                                         std::optional<double>, bool, bool, bool, bool, at::OptionalIntArrayRef);

std::optional<Tensor> Optional(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

// Saved for the backward: the normalised input (x, or h with a residual), mean and rstd
// (fp32 per row), scale and offset (for their dtypes and scale's values).
class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& scale,
                             const std::optional<Tensor>& offset, const std::optional<Tensor>& residual, int64_t axis,
                             std::optional<double> epsilon, std::optional<double> scale_offset, bool subtract_mean,
                             at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("tokamax::layer_norm", "").typed<ForwardSignature>();
    Tensor y, h, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, h, mean, rstd) =
          op.call(x, scale, offset, residual, axis, epsilon, scale_offset, subtract_mean, config, bwd_config);
    }
    ctx->set_materialize_grads(false);  // the backward handles an unused y or h itself
    ctx->saved_data["scale_offset"] = scale_offset ? c10::IValue(*scale_offset) : c10::IValue();
    ctx->saved_data["subtract_mean"] = subtract_mean;
    ctx->saved_data["has_residual"] = residual.has_value();
    ctx->saved_data["bwd_config"] = bwd_config.has_value() ? bwd_config->vec() : std::vector<int64_t>{};
    ctx->save_for_backward({residual.has_value() ? h : x, mean, rstd, scale.value_or(Tensor()),
                            offset.value_or(Tensor())});
    return {y, h, mean, rstd};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("tokamax::_layer_norm_backward", "").typed<BackwardSignature>();
    const auto saved = ctx->get_saved_variables();
    const Tensor& xh = saved[0];
    const bool has_residual = ctx->saved_data["has_residual"].toBool();
    const std::optional<Tensor> scale = Optional(saved[3]), offset = Optional(saved[4]);
    // Only h may be used downstream: y's cotangent is then zero.
    const Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(xh);
    const std::optional<Tensor> dh = has_residual ? Optional(grads[1]) : std::nullopt;
    // needs_input_grad counts the tensor inputs present: x, then scale, offset, residual if given.
    int64_t input = 0;
    const bool x_grad = ctx->needs_input_grad(input++);
    const bool scale_grad = scale.has_value() && ctx->needs_input_grad(input++);
    const bool offset_grad = offset.has_value() && ctx->needs_input_grad(input++);
    const bool residual_needed = has_residual && ctx->needs_input_grad(input++);
    // dresidual equals dx: a second copy (written in the same pass) only when both are wanted.
    const bool residual_copy = residual_needed && x_grad;
    const std::vector<int64_t> config = ctx->saved_data["bwd_config"].toIntVector();  // empty: heuristic
    auto [dx, dresidual, dscale, doffset] =
        op.call(dy, dh, xh, saved[1], saved[2], scale, offset, ctx->saved_data["scale_offset"].toOptional<double>(),
                ctx->saved_data["subtract_mean"].toBool(), scale_grad, offset_grad, residual_copy,
                config.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(config));
    tensor_list result(10);  // one per forward argument
    if (x_grad) result[0] = dx;
    if (scale_grad) result[1] = dscale;
    if (offset_grad) result[2] = doffset;
    if (residual_needed) result[3] = residual_copy ? dresidual : dx;
    return result;
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> LayerNormAutograd(const Tensor& x, const std::optional<Tensor>& scale,
                                                             const std::optional<Tensor>& offset,
                                                             const std::optional<Tensor>& residual, int64_t axis,
                                                             std::optional<double> epsilon,
                                                             std::optional<double> scale_offset, bool subtract_mean,
                                                             at::OptionalIntArrayRef config,
                                                             at::OptionalIntArrayRef bwd_config) {
  if (auto reference = RunReferenceWhereFunctionCannot<std::tuple<Tensor, Tensor, Tensor, Tensor>>(
          kOp, x, scale, offset, residual, axis, epsilon, scale_offset, subtract_mean, config, bwd_config)) {
    return *reference;
  }
  const tensor_list out = LayerNormFunction::apply(x, scale, offset, residual, axis, epsilon, scale_offset,
                                                   subtract_mean, config, bwd_config);
  // mean and rstd, and h without a residual, are not differentiable: detached here rather than
  // marked in the Function (compiled autograd asserts that no C++ Function marks an output
  // non-differentiable).
  return {out[0], residual.has_value() ? out[1] : out[1].detach(), out[2].detach(), out[3].detach()};
}

// The problem of the config helper ops (op_kit.h): the call's rows, columns and dtype.
ConfigProblem<LayerNormShape> LayerNormConfigProblem(const Tensor& x, int64_t axis) {
  CheckLayerNormArgs(x, std::nullopt, std::nullopt, std::nullopt, axis, std::nullopt);
  return {ShapeOf(x), ToCoreDType(x.scalar_type(), kOp)};
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_LAYER_NORM_ARGS                                                                               \
  "(Tensor x, Tensor? scale=None, Tensor? offset=None, Tensor? residual=None, int axis=-1, "                   \
  "float? epsilon=None, float? scale_offset=None, bool subtract_mean=True, int[]? config=None, "               \
  "int[]? bwd_config=None) -> (Tensor y, Tensor h, Tensor mean, Tensor rstd)"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("layer_norm" TOKAMAX_LAYER_NORM_ARGS);
  m.def("layer_norm_reference" TOKAMAX_LAYER_NORM_ARGS);
  m.def("_layer_norm_backward(Tensor dy, Tensor? dh, Tensor x, Tensor mean, Tensor rstd, Tensor? scale, "
        "Tensor? offset, float? scale_offset, bool subtract_mean, bool scale_grad, bool offset_grad, "
        "bool residual_grad, int[]? config=None) -> (Tensor dx, Tensor dresidual, Tensor dscale, Tensor doffset)");
  tokamax::DefineConfigOps<&tokamax::LayerNormConfigProblem, &tokamax::LayerNormHeuristicConfig,
                           &tokamax::LayerNormConfigSpace>(m, "Tensor x, int axis=-1");
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("layer_norm", &tokamax::LayerNormCpu);
  m.impl("_layer_norm_backward", &tokamax::LayerNormBackwardCpu);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("layer_norm", &tokamax::LayerNormMeta);
  m.impl("_layer_norm_backward", &tokamax::LayerNormBackwardMeta);
}

TORCH_LIBRARY_IMPL(tokamax, CompositeImplicitAutograd, m) {
  m.impl("layer_norm_reference", &tokamax::LayerNormAtenReference);
}

TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("layer_norm", &tokamax::LayerNormAutograd);
}
