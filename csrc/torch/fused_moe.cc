// tokamax::fused_experts and tokamax::fused_moe and their references: schemas, the one argument
// check, the CPU kernels and their backward ops, the dense ATen references, SymInt Meta kernels,
// C++ autograd and the config helper ops.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/ops/fused_moe/fused_moe.h"
#include "csrc/torch/adapter_utils.h"
#include "csrc/torch/op_kit.h"

namespace tokamax {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;
using Grads = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

Activation ParseActFn(const char* op, c10::string_view act_fn) {
  if (act_fn == "silu") return Activation::kSilu;
  if (act_fn == "gelu") return Activation::kGeluTanh;
  TORCH_CHECK(false, op, ": act_fn must be \"silu\" or \"gelu\" (tanh approximation), got \"", std::string(act_fn),
              "\"");
}

// The checks both entries share: x, the weights, the biases and act_fn. Metadata only.
void CheckExpertsArgs(const char* op, const Tensor& x, const Tensor& w1, const Tensor& w2, const OptTensor& w1_bias,
                      const OptTensor& w2_bias, c10::string_view act_fn) {
  ParseActFn(op, act_fn);
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [T, H], got shape ", ShapeString(x));
  TORCH_CHECK(IsSupportedFloat(x.scalar_type()), op, ": x must be float32, bfloat16, float16 or float64, got ",
              x.scalar_type());
  TORCH_CHECK(w1.dim() == 3, op, ": w1 must be 3-D [E, H, 2I], got shape ", ShapeString(w1));
  TORCH_CHECK(w2.dim() == 3, op, ": w2 must be 3-D [E, I, H], got shape ", ShapeString(w2));
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"w1", &w1}, {"w2", &w2}}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype ", x.scalar_type(),
                ", got ", t->scalar_type());
    TORCH_CHECK(t->device() == x.device(), op, ": ", name, " must be on x's device ", x.device(), ", got ",
                t->device());
  }
  const c10::SymInt e = w1.sym_size(0), h = x.sym_size(1), inter = w2.sym_size(1);
  TORCH_SYM_CHECK(w1.sym_size(1).sym_eq(h), op, ": w1 must be [E, H, 2I] with H = x.size(1) = ", h, ", got shape ",
                  ShapeString(w1));
  TORCH_SYM_CHECK(w2.sym_size(0).sym_eq(e).sym_and(w2.sym_size(2).sym_eq(h)), op, ": w2 must be [E, I, H] = [", e,
                  ", I, ", h, "], got shape ", ShapeString(w2));
  TORCH_SYM_CHECK(w1.sym_size(2).sym_eq(inter * 2), op, ": w1 must be [E, H, 2I] with 2I = 2 * w2.size(1) = ",
                  inter * 2, ", got shape ", ShapeString(w1));
  const std::pair<const char*, const OptTensor*> biases[] = {{"w1_bias", &w1_bias}, {"w2_bias", &w2_bias}};
  for (const auto& [name, bias] : biases) {
    if (!bias->has_value()) continue;
    const Tensor& b = **bias;
    const c10::SymInt cols = name == std::string("w1_bias") ? inter * 2 : h;
    TORCH_CHECK(b.dim() == 2 && b.scalar_type() == x.scalar_type() && b.device() == x.device(), op, ": ", name,
                " must be a 2-D ", x.scalar_type(), " tensor on x's device, got ", b.scalar_type(), ShapeString(b));
    TORCH_SYM_CHECK(b.sym_size(0).sym_eq(e).sym_and(b.sym_size(1).sym_eq(cols)), op, ": ", name, " must be [", e, ", ",
                    cols, "], got shape ", ShapeString(b));
  }
}

void CheckRouting(const char* op, const Tensor& x, const Tensor& topk_weights, const Tensor& topk_ids) {
  TORCH_CHECK(topk_ids.dim() == 2, op, ": topk_ids must be 2-D [T, k], got shape ", ShapeString(topk_ids));
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong, op,
              ": topk_ids must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_weights.dim() == 2 && IsSupportedFloat(topk_weights.scalar_type()), op,
              ": topk_weights must be a 2-D [T, k] float tensor, got ", topk_weights.scalar_type(),
              ShapeString(topk_weights));
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"topk_weights", &topk_weights},
                                {"topk_ids", &topk_ids}}) {
    TORCH_CHECK(t->device() == x.device(), op, ": ", name, " must be on x's device ", x.device(), ", got ",
                t->device());
  }
  TORCH_SYM_CHECK(topk_ids.sym_size(0).sym_eq(x.sym_size(0)), op, ": topk_ids must be [T, k] with T = x.size(0) = ",
                  x.sym_size(0), ", got shape ", ShapeString(topk_ids));
  TORCH_SYM_CHECK(topk_weights.sym_size(0).sym_eq(topk_ids.sym_size(0)).sym_and(
                      topk_weights.sym_size(1).sym_eq(topk_ids.sym_size(1))),
                  op, ": topk_weights must have topk_ids' shape ", ShapeString(topk_ids), ", got shape ",
                  ShapeString(topk_weights));
}

void CheckGating(const Tensor& x, const Tensor& w1, const Tensor& gating, const c10::SymInt& topk) {
  constexpr const char* op = "fused_moe";
  TORCH_CHECK(gating.dim() == 2 && IsSupportedFloat(gating.scalar_type()), op,
              ": gating must be a 2-D [T, E] float tensor, got ", gating.scalar_type(), ShapeString(gating));
  TORCH_CHECK(gating.device() == x.device(), op, ": gating must be on x's device ", x.device(), ", got ",
              gating.device());
  TORCH_SYM_CHECK(gating.sym_size(0).sym_eq(x.sym_size(0)).sym_and(gating.sym_size(1).sym_eq(w1.sym_size(0))), op,
                  ": gating must be [T, E] = [", x.sym_size(0), ", ", w1.sym_size(0), "], got shape ",
                  ShapeString(gating));
  TORCH_SYM_CHECK(topk.sym_ge(1).sym_and(topk.sym_le(w1.sym_size(0))), op, ": topk must be in [1, E=", w1.sym_size(0),
                  "], got ", topk);
}

struct ExpertsConfigs {
  std::optional<FusedExpertsConfig> forward, backward;
};

ExpertsConfigs CheckFusedExpertsArgs(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& topk_weights,
                                     const Tensor& topk_ids, c10::string_view act_fn, const OptTensor& w1_bias,
                                     const OptTensor& w2_bias, at::OptionalIntArrayRef config = std::nullopt,
                                     at::OptionalIntArrayRef bwd_config = std::nullopt) {
  ExpertsConfigs configs{ParseOptionalConfig<FusedExpertsConfig>(config, "config"),
                         ParseOptionalConfig<FusedExpertsConfig>(bwd_config, "bwd_config")};
  CheckExpertsArgs("fused_experts", x, w1, w2, w1_bias, w2_bias, act_fn);
  CheckRouting("fused_experts", x, topk_weights, topk_ids);
  return configs;
}

struct MoeConfigs {
  std::optional<FusedMoeConfig> forward, backward;
};

MoeConfigs CheckFusedMoeArgs(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& gating,
                             const c10::SymInt& topk, c10::string_view act_fn, const OptTensor& w1_bias,
                             const OptTensor& w2_bias, at::OptionalIntArrayRef config = std::nullopt,
                             at::OptionalIntArrayRef bwd_config = std::nullopt) {
  MoeConfigs configs{ParseOptionalConfig<FusedMoeConfig>(config, "config"),
                     ParseOptionalConfig<FusedMoeConfig>(bwd_config, "bwd_config")};
  CheckExpertsArgs("fused_moe", x, w1, w2, w1_bias, w2_bias, act_fn);
  CheckGating(x, w1, gating, topk);
  return configs;
}

FusedExpertsShape ShapeOf(const Tensor& x, const Tensor& w1, const Tensor& w2, int64_t topk) {
  FusedExpertsShape shape{x.size(0), x.size(1), w2.size(1), w1.size(0), topk};
  shape.weights_in_place = ColumnsContiguous(w1) && ColumnsContiguous(w2);
  return shape;
}

StridedView<2> OptionalView(const OptTensor& t) {
  return t.has_value() ? StridedViewOf<2>(*t, "fused_experts") : StridedView<2>{};
}

FusedExpertsParams ParamsOf(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& topk_weights,
                            const Tensor& topk_ids, c10::string_view act_fn, const OptTensor& w1_bias,
                            const OptTensor& w2_bias) {
  constexpr const char* op = "fused_experts";
  FusedExpertsParams params;
  params.activation = ParseActFn(op, act_fn);
  params.x = StridedViewOf<2>(x, op);
  params.w1 = StridedViewOf<3>(w1, op);
  params.w2 = StridedViewOf<3>(w2, op);
  params.w1_bias = OptionalView(w1_bias);
  params.w2_bias = OptionalView(w2_bias);
  params.topk_weights = StridedViewOf<2>(topk_weights, op);
  params.topk_ids = {topk_ids.const_data_ptr(), topk_ids.scalar_type() == at::kLong, topk_ids.size(0),
                     topk_ids.size(1), topk_ids.stride(0), topk_ids.stride(1)};
  return params;
}

// With `residuals`, also the pre-activations the backward reads ([T*k, 2I] in x's dtype, rows in
// the kernel's sorted order).
Tensor RunExperts(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& topk_weights,
                  const Tensor& topk_ids, c10::string_view act_fn, const OptTensor& w1_bias, const OptTensor& w2_bias,
                  const FusedExpertsConfig& config, Tensor* residuals = nullptr) {
  Tensor out = NewOutput(x.sizes(), x.options());
  FusedExpertsParams params = ParamsOf(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias);
  params.out = MutableStridedViewOf<2>(out, "fused_experts");
  if (residuals != nullptr) {
    *residuals = NewOutput({topk_ids.numel(), w1.size(2)}, x.options());
    params.residuals = residuals->data_ptr();
  }
  const Status status = FusedExperts(params, config);
  TORCH_CHECK(status.ok(), status.message());
  return out;
}

// A gradient laid out as its input (a transposed weight view gets a transposed gradient, so the
// caller's transpose back is contiguous).
Tensor GradLike(const Tensor& t) {
  return NewOutputLike(t);
}

Grads RunExpertsBackward(const Tensor& dout, const Tensor& x, const Tensor& w1, const Tensor& w2,
                         const Tensor& topk_weights, const Tensor& topk_ids, c10::string_view act_fn,
                         const OptTensor& w1_bias, const OptTensor& w2_bias, const FusedExpertsConfig& config,
                         const OptTensor& residuals) {
  TORCH_CHECK(dout.sizes() == x.sizes() && dout.scalar_type() == x.scalar_type(), "fused_experts backward: dout must be ",
              x.scalar_type(), ShapeString(x), ", got ", dout.scalar_type(), ShapeString(dout));
  constexpr const char* op = "fused_experts";
  Tensor dx = NewOutput(x.sizes(), x.options()), dw1 = GradLike(w1), dw2 = GradLike(w2);
  Tensor db1 = w1_bias ? NewOutput(w1_bias->sizes(), w1_bias->options()) : at::empty({0}, x.options());
  Tensor db2 = w2_bias ? NewOutput(w2_bias->sizes(), w2_bias->options()) : at::empty({0}, x.options());
  Tensor dtw = NewOutput(topk_weights.sizes(), topk_weights.options());
  FusedExpertsParams params = ParamsOf(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias);
  params.dout = StridedViewOf<2>(dout, op);
  params.dx = MutableStridedViewOf<2>(dx, op);
  params.dw1 = MutableStridedViewOf<3>(dw1, op);
  params.dw2 = MutableStridedViewOf<3>(dw2, op);
  if (w1_bias) params.dw1_bias = MutableStridedViewOf<2>(db1, op);
  if (w2_bias) params.dw2_bias = MutableStridedViewOf<2>(db2, op);
  params.dtopk_weights = MutableStridedViewOf<2>(dtw, op);
  if (residuals.has_value()) {
    const Tensor& r = *residuals;
    TORCH_CHECK(r.dim() == 2 && r.size(0) == topk_ids.numel() && r.size(1) == w1.size(2) &&
                    r.scalar_type() == x.scalar_type() && r.is_contiguous(),
                "fused_experts backward: residuals must be a contiguous ", x.scalar_type(), " [T*k, 2I] = [",
                topk_ids.numel(), ", ", w1.size(2), "] tensor (the forward's), got ", r.scalar_type(), ShapeString(r));
    params.residuals = const_cast<void*>(r.const_data_ptr());
  }
  const Status status = FusedExpertsBackward(params, config);
  TORCH_CHECK(status.ok(), status.message());
  return {dx, dw1, dw2, db1, db2, dtw};
}

Grads BackwardMeta(const Tensor& x, const Tensor& w1, const Tensor& w2, const OptTensor& w1_bias,
                   const OptTensor& w2_bias, const Tensor& routing_grad_like) {
  auto like = [&](const Tensor& t) { return at::empty_symint(t.sym_sizes(), t.options()); };
  auto grad_like = [&](const Tensor& t) {
    return t.is_non_overlapping_and_dense() ? at::empty_like(t) : like(t);
  };
  return {like(x),
          grad_like(w1),
          grad_like(w2),
          w1_bias ? like(*w1_bias) : at::empty({0}, x.options()),
          w2_bias ? like(*w2_bias) : at::empty({0}, x.options()),
          like(routing_grad_like)};
}

// ---- fused_experts ----------------------------------------------------------------------------

Tensor FusedExpertsCpu(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& topk_weights,
                       const Tensor& topk_ids, c10::string_view act_fn, const OptTensor& w1_bias,
                       const OptTensor& w2_bias, at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  const ExpertsConfigs configs =
      CheckFusedExpertsArgs(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, config, bwd_config);
  const FusedExpertsConfig resolved = ConfigOrHeuristic<&FusedExpertsHeuristicConfig>(
      configs.forward, ShapeOf(x, w1, w2, topk_ids.size(1)), ToCoreDType(x.scalar_type(), "fused_experts"),
      FusedExpertsProduct::kForward);
  return RunExperts(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, resolved);
}

Grads FusedExpertsBackwardCpu(const Tensor& dout, const Tensor& x, const Tensor& w1, const Tensor& w2,
                              const Tensor& topk_weights, const Tensor& topk_ids, c10::string_view act_fn,
                              const OptTensor& w1_bias, const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                              const OptTensor& residuals) {
  const ExpertsConfigs configs =
      CheckFusedExpertsArgs(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, config);
  const FusedExpertsConfig resolved = ConfigOrHeuristic<&FusedExpertsHeuristicConfig>(
      configs.forward, ShapeOf(x, w1, w2, topk_ids.size(1)), ToCoreDType(x.scalar_type(), "fused_experts"),
      FusedExpertsProduct::kBackward);
  return RunExpertsBackward(dout, x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, resolved, residuals);
}

Tensor FusedExpertsMeta(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& topk_weights,
                        const Tensor& topk_ids, c10::string_view act_fn, const OptTensor& w1_bias,
                        const OptTensor& w2_bias, at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  CheckFusedExpertsArgs(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, config, bwd_config);
  return at::empty_symint(x.sym_sizes(), x.options());
}

// The forward a backward will follow: also returns the pre-activations it saves.
std::tuple<Tensor, Tensor> FusedExpertsTrainCpu(const Tensor& x, const Tensor& w1, const Tensor& w2,
                                                const Tensor& topk_weights, const Tensor& topk_ids,
                                                c10::string_view act_fn, const OptTensor& w1_bias,
                                                const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                                                at::OptionalIntArrayRef bwd_config) {
  const ExpertsConfigs configs =
      CheckFusedExpertsArgs(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, config, bwd_config);
  const FusedExpertsConfig resolved = ConfigOrHeuristic<&FusedExpertsHeuristicConfig>(
      configs.forward, ShapeOf(x, w1, w2, topk_ids.size(1)), ToCoreDType(x.scalar_type(), "fused_experts"),
      FusedExpertsProduct::kForward);
  Tensor residuals;
  Tensor out = RunExperts(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, resolved, &residuals);
  return {out, residuals};
}

Tensor ResidualsMeta(const Tensor& x, const Tensor& w1, const c10::SymInt& topk) {
  return at::empty_symint({x.sym_size(0) * topk, w1.sym_size(2)}, x.options());
}

std::tuple<Tensor, Tensor> FusedExpertsTrainMeta(const Tensor& x, const Tensor& w1, const Tensor& w2,
                                                 const Tensor& topk_weights, const Tensor& topk_ids,
                                                 c10::string_view act_fn, const OptTensor& w1_bias,
                                                 const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                                                 at::OptionalIntArrayRef bwd_config) {
  CheckFusedExpertsArgs(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, config, bwd_config);
  return {at::empty_symint(x.sym_sizes(), x.options()), ResidualsMeta(x, w1, topk_ids.sym_size(1))};
}

Grads FusedExpertsBackwardMeta(const Tensor& dout, const Tensor& x, const Tensor& w1, const Tensor& w2,
                               const Tensor& topk_weights, const Tensor& topk_ids, c10::string_view act_fn,
                               const OptTensor& w1_bias, const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                               const OptTensor&) {
  CheckFusedExpertsArgs(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, config);
  return BackwardMeta(x, w1, w2, w1_bias, w2_bias, topk_weights);
}

// The dense reference: every expert on every token, each weighted by its summed routing weight
// (zero for experts a token does not use), in fp32 (float64 for float64). E times the kernel's
// work, but plain ATen: autograd and shapes by decomposition. An out-of-range id fails in
// scatter_add with ATen's message.
Tensor ExpertsReference(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& topk_weights,
                        const Tensor& topk_ids, c10::string_view act_fn, const OptTensor& w1_bias,
                        const OptTensor& w2_bias) {
  const at::ScalarType wide = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const c10::SymInt inter = w2.sym_size(1);
  const Tensor combine = at::zeros_symint({x.sym_size(0), w1.sym_size(0)}, x.options().dtype(wide))
                             .scatter_add(1, topk_ids.to(at::kLong), topk_weights.to(wide));  // [T, E]
  Tensor pre = at::matmul(x.to(wide).unsqueeze(0), w1.to(wide));                             // [E, T, 2I]
  if (w1_bias) pre = pre + w1_bias->to(wide).unsqueeze(1);
  const Tensor gate = pre.narrow_symint(2, 0, inter), up = pre.narrow_symint(2, inter, inter);
  const Tensor act = ParseActFn("fused_experts", act_fn) == Activation::kSilu ? at::silu(gate)
                                                                               : at::gelu(gate, "tanh");
  Tensor y = at::matmul(act * up, w2.to(wide));  // [E, T, H]
  if (w2_bias) y = y + w2_bias->to(wide).unsqueeze(1);
  return (combine.t().unsqueeze(2) * y).sum(0).to(x.scalar_type());
}

Tensor FusedExpertsReference(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& topk_weights,
                             const Tensor& topk_ids, c10::string_view act_fn, const OptTensor& w1_bias,
                             const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                             at::OptionalIntArrayRef bwd_config) {
  CheckFusedExpertsArgs(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, config, bwd_config);
  return ExpertsReference(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias);
}

using ExpertsSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                c10::string_view, const OptTensor&, const OptTensor&, at::OptionalIntArrayRef,
                                at::OptionalIntArrayRef);
using ExpertsTrainSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                         const Tensor&, c10::string_view, const OptTensor&,
                                                         const OptTensor&, at::OptionalIntArrayRef,
                                                         at::OptionalIntArrayRef);
using ExpertsBackwardSignature = Grads(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                       const Tensor&, c10::string_view, const OptTensor&, const OptTensor&,
                                       at::OptionalIntArrayRef, const OptTensor&);

OptTensor Defined(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

std::vector<int64_t> ConfigVector(at::OptionalIntArrayRef config) {
  return config.has_value() ? config->vec() : std::vector<int64_t>{};
}
at::OptionalIntArrayRef ConfigRef(const std::vector<int64_t>& config) {
  return config.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(config);
}

// The plain op runs unless a backward can follow or a tangent is attached
// (NeedsAutogradFunction): the autograd Function's forward saves its pre-activations for the
// backward (whose gate|up product otherwise runs again: a fifth of its products), a [T*k, 2I] buffer (176 MiB at T=4096 top-2 I=2816 fp32) that generation
// under no_grad, whose parameters still require grad, must not pay for.
class FusedExpertsFunction : public torch::autograd::Function<FusedExpertsFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w1, const Tensor& w2,
                        const Tensor& topk_weights, const Tensor& topk_ids, c10::string_view act_fn,
                        const OptTensor& w1_bias, const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                        at::OptionalIntArrayRef bwd_config) {
    ctx->saved_data["act_fn"] = std::string(act_fn);
    ctx->saved_data["bwd_config"] = ConfigVector(bwd_config);
    static const auto train = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("tokamax::_fused_experts_train", "")
                                  .typed<ExpertsTrainSignature>();
    Tensor out, residuals;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out, residuals) =
          train.call(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, config, bwd_config);
    }
    ctx->save_for_backward({x, w1, w2, topk_weights, topk_ids, w1_bias.value_or(Tensor()),
                            w2_bias.value_or(Tensor()), residuals});
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("tokamax::_fused_experts_backward", "")
                               .typed<ExpertsBackwardSignature>();
    const auto s = ctx->get_saved_variables();
    const std::string act_fn = ctx->saved_data["act_fn"].toStringRef();
    const std::vector<int64_t> config = ctx->saved_data["bwd_config"].toIntVector();
    const OptTensor b1 = Defined(s[5]), b2 = Defined(s[6]);
    auto [dx, dw1, dw2, db1, db2, dtw] =
        op.call(grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], act_fn, b1, b2, ConfigRef(config), Defined(s[7]));
    return {dx, dw1, dw2, dtw, Tensor(), Tensor(), b1 ? db1 : Tensor(), b2 ? db2 : Tensor(), Tensor(), Tensor()};
  }
};

Tensor FusedExpertsAutograd(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& topk_weights,
                            const Tensor& topk_ids, c10::string_view act_fn, const OptTensor& w1_bias,
                            const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                            at::OptionalIntArrayRef bwd_config) {
  if (!NeedsAutogradFunction({&x, &w1, &w2, &topk_weights}, {&w1_bias, &w2_bias})) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("tokamax::fused_experts", "").typed<ExpertsSignature>();
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, config, bwd_config);
  }
  if (auto reference = RunReferenceWhereFunctionCannot<Tensor>("fused_experts", x, w1, w2, topk_weights, topk_ids, act_fn,
                                                          w1_bias, w2_bias, config, bwd_config)) {
    return *reference;
  }
  return FusedExpertsFunction::apply(x, w1, w2, topk_weights, topk_ids, act_fn, w1_bias, w2_bias, config, bwd_config);
}

ConfigProblem<FusedExpertsShape> FusedExpertsConfigProblem(const Tensor& x, const Tensor& w1, const Tensor& w2,
                                                           const Tensor& topk_ids) {
  CheckExpertsArgs("fused_experts", x, w1, w2, std::nullopt, std::nullopt, "silu");
  TORCH_CHECK(topk_ids.dim() == 2, "fused_experts: topk_ids must be 2-D [T, k], got shape ", ShapeString(topk_ids));
  return {ShapeOf(x, w1, w2, topk_ids.size(1)), ToCoreDType(x.scalar_type(), "fused_experts")};
}

// ---- fused_moe --------------------------------------------------------------------------------

std::pair<Tensor, Tensor> Route(const Tensor& gating, int64_t topk, bool renormalize) {
  Tensor weights = NewOutput({gating.size(0), topk}, gating.options().dtype(at::kFloat));
  Tensor ids = NewOutput({gating.size(0), topk}, gating.options().dtype(at::kInt));
  MoeRouterParams params;
  params.gating = StridedViewOf<2>(gating, "fused_moe");
  params.k = topk;
  params.renormalize = renormalize;
  params.weights = weights.data_ptr<float>();
  params.ids = ids.data_ptr<int32_t>();
  const Status status = MoeRouter(params);
  TORCH_CHECK(status.ok(), status.message());
  return {weights, ids};
}

// Every fused_moe kernel's start: the argument checks, the config of `product` (given or by
// heuristic) and the routing.
std::tuple<FusedMoeConfig, Tensor, Tensor> CheckConfigAndRoute(
    const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& gating, int64_t topk, bool renormalize,
    c10::string_view act_fn, const OptTensor& w1_bias, const OptTensor& w2_bias, at::OptionalIntArrayRef config,
    at::OptionalIntArrayRef bwd_config, FusedMoeProduct product) {
  const MoeConfigs configs =
      CheckFusedMoeArgs(x, w1, w2, gating, topk, act_fn, w1_bias, w2_bias, config, bwd_config);
  const FusedMoeConfig resolved = ConfigOrHeuristic<&FusedMoeHeuristicConfig>(
      configs.forward, ShapeOf(x, w1, w2, topk), ToCoreDType(x.scalar_type(), "fused_moe"), product);
  auto [weights, ids] = Route(gating, topk, renormalize);
  return {resolved, weights, ids};
}

Tensor FusedMoeCpu(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& gating, int64_t topk,
                   bool renormalize, c10::string_view act_fn, const OptTensor& w1_bias, const OptTensor& w2_bias,
                   at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  const auto [resolved, weights, ids] = CheckConfigAndRoute(x, w1, w2, gating, topk, renormalize, act_fn, w1_bias,
                                                            w2_bias, config, bwd_config, FusedMoeProduct::kForward);
  return RunExperts(x, w1, w2, weights, ids, act_fn, w1_bias, w2_bias, ToExpertsConfig(resolved));
}

std::tuple<Tensor, Tensor> FusedMoeTrainCpu(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& gating,
                                            int64_t topk, bool renormalize, c10::string_view act_fn,
                                            const OptTensor& w1_bias, const OptTensor& w2_bias,
                                            at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  const auto [resolved, weights, ids] = CheckConfigAndRoute(x, w1, w2, gating, topk, renormalize, act_fn, w1_bias,
                                                            w2_bias, config, bwd_config, FusedMoeProduct::kForward);
  Tensor residuals;
  Tensor out = RunExperts(x, w1, w2, weights, ids, act_fn, w1_bias, w2_bias, ToExpertsConfig(resolved), &residuals);
  return {out, residuals};
}

Grads FusedMoeBackwardCpu(const Tensor& dout, const Tensor& x, const Tensor& w1, const Tensor& w2,
                          const Tensor& gating, int64_t topk, bool renormalize, c10::string_view act_fn,
                          const OptTensor& w1_bias, const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                          const OptTensor& residuals) {
  const auto [resolved, weights, ids] = CheckConfigAndRoute(x, w1, w2, gating, topk, renormalize, act_fn, w1_bias,
                                                            w2_bias, config, std::nullopt, FusedMoeProduct::kBackward);
  auto [dx, dw1, dw2, db1, db2, dweights] = RunExpertsBackward(dout, x, w1, w2, weights, ids, act_fn, w1_bias,
                                                                w2_bias, ToExpertsConfig(resolved), residuals);
  Tensor dgating = NewOutput(gating.sizes(), gating.options());
  MoeRouterParams params;
  params.gating = StridedViewOf<2>(gating, "fused_moe");
  params.k = topk;
  params.renormalize = renormalize;
  params.ids = ids.data_ptr<int32_t>();
  params.dweights = dweights.const_data_ptr<float>();
  params.dgating = MutableStridedViewOf<2>(dgating, "fused_moe");
  const Status status = MoeRouterBackward(params);
  TORCH_CHECK(status.ok(), status.message());
  return {dx, dw1, dw2, db1, db2, dgating};
}

Tensor FusedMoeMeta(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& gating, c10::SymInt topk,
                    bool renormalize, c10::string_view act_fn, const OptTensor& w1_bias, const OptTensor& w2_bias,
                    at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  CheckFusedMoeArgs(x, w1, w2, gating, topk, act_fn, w1_bias, w2_bias, config, bwd_config);
  return at::empty_symint(x.sym_sizes(), x.options());
}

std::tuple<Tensor, Tensor> FusedMoeTrainMeta(const Tensor& x, const Tensor& w1, const Tensor& w2,
                                             const Tensor& gating, c10::SymInt topk, bool renormalize,
                                             c10::string_view act_fn, const OptTensor& w1_bias,
                                             const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                                             at::OptionalIntArrayRef bwd_config) {
  CheckFusedMoeArgs(x, w1, w2, gating, topk, act_fn, w1_bias, w2_bias, config, bwd_config);
  return {at::empty_symint(x.sym_sizes(), x.options()), ResidualsMeta(x, w1, topk)};
}

Grads FusedMoeBackwardMeta(const Tensor& dout, const Tensor& x, const Tensor& w1, const Tensor& w2,
                           const Tensor& gating, c10::SymInt topk, bool renormalize, c10::string_view act_fn,
                           const OptTensor& w1_bias, const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                           const OptTensor&) {
  CheckFusedMoeArgs(x, w1, w2, gating, topk, act_fn, w1_bias, w2_bias, config);
  return BackwardMeta(x, w1, w2, w1_bias, w2_bias, gating);
}

// softmax in fp32 (float64 for float64), a stable descending sort (ties keep the lower id first),
// the first topk, optionally renormalised; then the experts' reference.
Tensor FusedMoeReference(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& gating, c10::SymInt topk,
                         bool renormalize, c10::string_view act_fn, const OptTensor& w1_bias,
                         const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                         at::OptionalIntArrayRef bwd_config) {
  CheckFusedMoeArgs(x, w1, w2, gating, topk, act_fn, w1_bias, w2_bias, config, bwd_config);
  const at::ScalarType wide = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor probs = at::softmax(gating.to(wide), 1);
  const auto [sorted, order] = at::sort(probs.detach(), /*stable=*/true, /*dim=*/1, /*descending=*/true);
  const Tensor ids = order.narrow_symint(1, 0, topk);
  Tensor weights = probs.gather(1, ids);
  if (renormalize) weights = weights / weights.sum(1, /*keepdim=*/true);
  return ExpertsReference(x, w1, w2, weights, ids, act_fn, w1_bias, w2_bias);
}

using MoeSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, c10::SymInt, bool,
                            c10::string_view, const OptTensor&, const OptTensor&, at::OptionalIntArrayRef,
                            at::OptionalIntArrayRef);
using MoeTrainSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                     c10::SymInt, bool, c10::string_view, const OptTensor&,
                                                     const OptTensor&, at::OptionalIntArrayRef,
                                                     at::OptionalIntArrayRef);
using MoeBackwardSignature = Grads(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   c10::SymInt, bool, c10::string_view, const OptTensor&, const OptTensor&,
                                   at::OptionalIntArrayRef, const OptTensor&);

class FusedMoeFunction : public torch::autograd::Function<FusedMoeFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w1, const Tensor& w2,
                        const Tensor& gating, c10::SymInt topk, bool renormalize, c10::string_view act_fn,
                        const OptTensor& w1_bias, const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                        at::OptionalIntArrayRef bwd_config) {
    ctx->saved_data["topk"] = topk;
    ctx->saved_data["renormalize"] = renormalize;
    ctx->saved_data["act_fn"] = std::string(act_fn);
    ctx->saved_data["bwd_config"] = ConfigVector(bwd_config);
    static const auto train =
        c10::Dispatcher::singleton().findSchemaOrThrow("tokamax::_fused_moe_train", "").typed<MoeTrainSignature>();
    Tensor out, residuals;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out, residuals) =
          train.call(x, w1, w2, gating, topk, renormalize, act_fn, w1_bias, w2_bias, config, bwd_config);
    }
    ctx->save_for_backward(
        {x, w1, w2, gating, w1_bias.value_or(Tensor()), w2_bias.value_or(Tensor()), residuals});
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("tokamax::_fused_moe_backward", "")
                               .typed<MoeBackwardSignature>();
    const auto s = ctx->get_saved_variables();
    const std::string act_fn = ctx->saved_data["act_fn"].toStringRef();
    const std::vector<int64_t> config = ctx->saved_data["bwd_config"].toIntVector();
    const OptTensor b1 = Defined(s[4]), b2 = Defined(s[5]);
    auto [dx, dw1, dw2, db1, db2, dgating] =
        op.call(grads[0].contiguous(), s[0], s[1], s[2], s[3], ctx->saved_data["topk"].toSymInt(),
                ctx->saved_data["renormalize"].toBool(), act_fn, b1, b2, ConfigRef(config), Defined(s[6]));
    return {dx,       dw1,      dw2,      dgating,  Tensor(), Tensor(),
            Tensor(), b1 ? db1 : Tensor(), b2 ? db2 : Tensor(), Tensor(), Tensor()};
  }
};

Tensor FusedMoeAutograd(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& gating, c10::SymInt topk,
                        bool renormalize, c10::string_view act_fn, const OptTensor& w1_bias,
                        const OptTensor& w2_bias, at::OptionalIntArrayRef config,
                        at::OptionalIntArrayRef bwd_config) {
  if (!NeedsAutogradFunction({&x, &w1, &w2, &gating}, {&w1_bias, &w2_bias})) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("tokamax::fused_moe", "").typed<MoeSignature>();
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, w1, w2, gating, topk, renormalize, act_fn, w1_bias, w2_bias, config, bwd_config);
  }
  if (auto reference = RunReferenceWhereFunctionCannot<Tensor>("fused_moe", x, w1, w2, gating, topk, renormalize, act_fn,
                                                          w1_bias, w2_bias, config, bwd_config)) {
    return *reference;
  }
  return FusedMoeFunction::apply(x, w1, w2, gating, topk, renormalize, act_fn, w1_bias, w2_bias, config, bwd_config);
}

ConfigProblem<FusedExpertsShape> FusedMoeConfigProblem(const Tensor& x, const Tensor& w1, const Tensor& w2,
                                                       const Tensor& gating, int64_t topk) {
  CheckExpertsArgs("fused_moe", x, w1, w2, std::nullopt, std::nullopt, "silu");
  CheckGating(x, w1, gating, topk);
  return {ShapeOf(x, w1, w2, topk), ToCoreDType(x.scalar_type(), "fused_moe")};
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_FUSED_EXPERTS_ARGS                                                                 \
  "(Tensor x, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, str act_fn=\"silu\", "  \
  "Tensor? w1_bias=None, Tensor? w2_bias=None, int[]? config=None, int[]? bwd_config=None) -> Tensor"
#define TOKAMAX_FUSED_MOE_ARGS                                                                          \
  "(Tensor x, Tensor w1, Tensor w2, Tensor gating, SymInt topk, bool renormalize=True, str act_fn=\"silu\", " \
  "Tensor? w1_bias=None, Tensor? w2_bias=None, int[]? config=None, int[]? bwd_config=None) -> Tensor"
// The forwards a backward follows: out and the pre-activations [T*k, 2I] the backward reads.
#define TOKAMAX_FUSED_EXPERTS_TRAIN_ARGS                                                                \
  "(Tensor x, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, str act_fn, Tensor? w1_bias, " \
  "Tensor? w2_bias, int[]? config=None, int[]? bwd_config=None) -> (Tensor out, Tensor residuals)"
#define TOKAMAX_FUSED_MOE_TRAIN_ARGS                                                                          \
  "(Tensor x, Tensor w1, Tensor w2, Tensor gating, SymInt topk, bool renormalize, str act_fn, Tensor? w1_bias, " \
  "Tensor? w2_bias, int[]? config=None, int[]? bwd_config=None) -> (Tensor out, Tensor residuals)"
#define TOKAMAX_FUSED_MOE_GRADS "(Tensor dx, Tensor dw1, Tensor dw2, Tensor dw1_bias, Tensor dw2_bias, Tensor drouting)"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("fused_experts" TOKAMAX_FUSED_EXPERTS_ARGS);
  m.def("fused_experts_reference" TOKAMAX_FUSED_EXPERTS_ARGS);
  m.def("_fused_experts_backward(Tensor dout, Tensor x, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
        "str act_fn, Tensor? w1_bias, Tensor? w2_bias, int[]? config=None, Tensor? residuals=None) -> "
        TOKAMAX_FUSED_MOE_GRADS);
  m.def("_fused_experts_train" TOKAMAX_FUSED_EXPERTS_TRAIN_ARGS);
  m.def("fused_moe" TOKAMAX_FUSED_MOE_ARGS);
  m.def("fused_moe_reference" TOKAMAX_FUSED_MOE_ARGS);
  m.def("_fused_moe_backward(Tensor dout, Tensor x, Tensor w1, Tensor w2, Tensor gating, SymInt topk, "
        "bool renormalize, str act_fn, Tensor? w1_bias, Tensor? w2_bias, int[]? config=None, Tensor? residuals=None) -> "
        TOKAMAX_FUSED_MOE_GRADS);
  m.def("_fused_moe_train" TOKAMAX_FUSED_MOE_TRAIN_ARGS);
  tokamax::DefineConfigOps<&tokamax::FusedExpertsConfigProblem, &tokamax::FusedExpertsHeuristicConfig,
                           &tokamax::FusedExpertsConfigSpace>(m, "Tensor x, Tensor w1, Tensor w2, Tensor topk_ids");
  tokamax::DefineConfigOps<&tokamax::FusedMoeConfigProblem, &tokamax::FusedMoeHeuristicConfig,
                           &tokamax::FusedMoeConfigSpace>(m, "Tensor x, Tensor w1, Tensor w2, Tensor gating, int topk");
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("fused_experts", &tokamax::FusedExpertsCpu);
  m.impl("_fused_experts_backward", &tokamax::FusedExpertsBackwardCpu);
  m.impl("_fused_experts_train", &tokamax::FusedExpertsTrainCpu);
  m.impl("fused_moe", &tokamax::FusedMoeCpu);
  m.impl("_fused_moe_backward", &tokamax::FusedMoeBackwardCpu);
  m.impl("_fused_moe_train", &tokamax::FusedMoeTrainCpu);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("fused_experts", &tokamax::FusedExpertsMeta);
  m.impl("_fused_experts_backward", &tokamax::FusedExpertsBackwardMeta);
  m.impl("_fused_experts_train", &tokamax::FusedExpertsTrainMeta);
  m.impl("fused_moe", &tokamax::FusedMoeMeta);
  m.impl("_fused_moe_backward", &tokamax::FusedMoeBackwardMeta);
  m.impl("_fused_moe_train", &tokamax::FusedMoeTrainMeta);
}

TORCH_LIBRARY_IMPL(tokamax, CompositeImplicitAutograd, m) {
  m.impl("fused_experts_reference", &tokamax::FusedExpertsReference);
  m.impl("fused_moe_reference", &tokamax::FusedMoeReference);
}

TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("fused_experts", &tokamax::FusedExpertsAutograd);
  m.impl("fused_moe", &tokamax::FusedMoeAutograd);
}

TORCH_LIBRARY_IMPL(tokamax, AutocastCPU, m) {
  tokamax::RegisterLowerPrecisionAutocast(m, {"fused_experts", "fused_experts_reference", "fused_moe", "fused_moe_reference"});
}
