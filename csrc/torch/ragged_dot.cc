// tokamax::ragged_dot and tokamax::ragged_dot_reference: schemas, the shared argument check,
// the CPU kernel adapter, the ATen reference, SymInt meta kernels and C++ autograd.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "csrc/core/runtime/cpu_info.h"
#include "csrc/torch/adapter_utils.h"
#include "csrc/torch/op_kit.h"
#include "csrc/ops/ragged_dot/ragged_dot.h"

namespace tokamax {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Configs as the kernel uses them: the forward one, and one per gradient product. bwd_config
// holds 5 values (one config for both products) or 10 (lhs gradient, then rhs gradient).
struct RaggedDotConfigs {
  std::optional<RaggedDotConfig> forward;
  std::optional<RaggedDotConfig> dlhs;
  std::optional<RaggedDotConfig> drhs;
};

// What the check derives from valid arguments: the form and the output's shape and dtype.
struct RaggedDotSignature {
  RaggedDotForm form;
  std::vector<c10::SymInt> out_shape;
  at::ScalarType out_dtype;
  RaggedDotConfigs configs;  // parsed and validated
};

RaggedDotConfigs ParseConfigs(at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  RaggedDotConfigs configs;
  configs.forward = ParseOptionalConfig<RaggedDotConfig>(config, "config");
  if (bwd_config.has_value()) {
    const size_t size = bwd_config->size();
    constexpr size_t kFields = RaggedDotConfig::kNumFields;
    TORCH_CHECK(size == kFields || size == 2 * kFields, "ragged_dot: bwd_config must hold ",
                kFields, " values (one config for both gradient products) or ", 2 * kFields,
                " (lhs gradient, then rhs gradient), got ", size);
    configs.dlhs = ParseConfig<RaggedDotConfig>(bwd_config->slice(0, kFields), "bwd_config");
    configs.drhs = size == kFields ? configs.dlhs
                                            : ParseConfig<RaggedDotConfig>(bwd_config->slice(kFields), "bwd_config");
  }
  return configs;
}

// The one argument check, shared by the kernel, the reference and their meta kernels, so eager
// and compiled code raise the same errors; the reference validates configs it does not use. Only
// metadata is read; group size values are checked by the kernels before any compute.
RaggedDotSignature CheckRaggedDotArgs(const Tensor& lhs, const Tensor& rhs, const Tensor& group_sizes,
                                      at::OptionalIntArrayRef dimension_numbers,
                                      std::optional<at::ScalarType> preferred_element_type,
                                      at::OptionalIntArrayRef config = std::nullopt,
                                      at::OptionalIntArrayRef bwd_config = std::nullopt) {
  RaggedDotSignature sig;
  sig.configs = ParseConfigs(config, bwd_config);  // invalid configs fail here, eager and compiled

  sig.form = RaggedDotForm::kDefault;
  if (dimension_numbers.has_value()) {
    const Status status = ParseRaggedDotDimensionNumbers(dimension_numbers->vec(), &sig.form);
    TORCH_CHECK(status.ok(), status.message());
  }
  const char* form = RaggedDotFormName(sig.form);
  TORCH_CHECK(IsSupportedFloat(lhs.scalar_type()),
              "ragged_dot: lhs must be float32, bfloat16, float16 or float64, got ", lhs.scalar_type());
  TORCH_CHECK(rhs.scalar_type() == lhs.scalar_type(), "ragged_dot: lhs and rhs must have the same dtype, got ",
              lhs.scalar_type(), " and ", rhs.scalar_type());
  TORCH_CHECK(group_sizes.scalar_type() == at::kInt || group_sizes.scalar_type() == at::kLong,
              "ragged_dot: group_sizes must be int32 or int64, got ", group_sizes.scalar_type());
  TORCH_CHECK(group_sizes.dim() == 1, "ragged_dot: group_sizes must be 1-D [G], got shape ",
              ShapeString(group_sizes));
  TORCH_CHECK(lhs.dim() == 2, "ragged_dot: lhs must be 2-D [M, K], got shape ", ShapeString(lhs));
  TORCH_CHECK(lhs.device() == rhs.device() && lhs.device() == group_sizes.device(),
              "ragged_dot: lhs, rhs and group_sizes must be on one device, got ", lhs.device(), ", ",
              rhs.device(), " and ", group_sizes.device());
  const c10::SymInt& m = lhs.sym_size(0);
  const c10::SymInt& k = lhs.sym_size(1);
  const c10::SymInt& g = group_sizes.sym_size(0);
  switch (sig.form) {
    case RaggedDotForm::kDefault:
    case RaggedDotForm::kTransRhs: {
      const bool trans = sig.form == RaggedDotForm::kTransRhs;
      TORCH_CHECK(rhs.dim() == 3, "ragged_dot (", form, "): rhs must be 3-D ", trans ? "[G, N, K]" : "[G, K, N]",
                  ", got shape ", ShapeString(rhs));
      const c10::SymInt& rhs_k = rhs.sym_size(trans ? 2 : 1);
      TORCH_SYM_CHECK(rhs_k.sym_eq(k), "ragged_dot (", form, "): rhs.shape[", trans ? 2 : 1,
                      "] (K) must equal lhs.shape[1] = ", k, ", got ", rhs_k);
      TORCH_SYM_CHECK(rhs.sym_size(0).sym_eq(g), "ragged_dot (", form,
                      "): rhs.shape[0] (G) must equal group_sizes.shape[0] = ", g, ", got ", rhs.sym_size(0));
      sig.out_shape = {m, rhs.sym_size(trans ? 1 : 2)};
      break;
    }
    case RaggedDotForm::kRaggedContracting:
      TORCH_CHECK(rhs.dim() == 2, "ragged_dot (", form, "): rhs must be 2-D [M, N], got shape ", ShapeString(rhs));
      TORCH_SYM_CHECK(rhs.sym_size(0).sym_eq(m), "ragged_dot (", form,
                      "): rhs.shape[0] (M) must equal lhs.shape[0] = ", m, ", got ", rhs.sym_size(0));
      sig.out_shape = {g, k, rhs.sym_size(1)};
      break;
  }
  sig.out_dtype = preferred_element_type.value_or(lhs.scalar_type());
  TORCH_CHECK(IsSupportedFloat(sig.out_dtype),
              "ragged_dot: preferred_element_type must be float32, bfloat16, float16 or float64, got ", sig.out_dtype);
  // float64 is computed by exact double loops end to end; mixing it with the fp32 GEMM path
  // would silently drop precision.
  TORCH_CHECK((lhs.scalar_type() == at::kDouble) == (sig.out_dtype == at::kDouble),
              "ragged_dot: float64 inputs need a float64 output and vice versa, got inputs ", lhs.scalar_type(),
              " and preferred_element_type ", sig.out_dtype);
  return sig;
}

Tensor EmptyOutput(const Tensor& lhs, const RaggedDotSignature& sig) {
  return NewOutputSymint(sig.out_shape, lhs.options().dtype(sig.out_dtype));
}

std::vector<int64_t> GroupSizesToVector(const Tensor& group_sizes) {
  const Tensor sizes = group_sizes.to(at::kLong).contiguous();
  const int64_t* data = sizes.const_data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + sizes.numel());
}

RaggedDotShape ShapeOf(const Tensor& lhs, const Tensor& group_sizes, const RaggedDotSignature& sig) {
  RaggedDotShape shape;
  shape.form = sig.form;
  shape.m = lhs.size(0);
  shape.k = lhs.size(1);
  shape.n = sig.out_shape.back().expect_int();
  shape.g = group_sizes.size(0);
  return shape;
}

// ---- the CPU kernel ----------------------------------------------------------------------------

Tensor RaggedDotCpu(const Tensor& lhs, const Tensor& rhs, const Tensor& group_sizes,
                    at::OptionalIntArrayRef dimension_numbers, std::optional<at::ScalarType> preferred_element_type,
                    at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  const RaggedDotSignature sig =
      CheckRaggedDotArgs(lhs, rhs, group_sizes, dimension_numbers, preferred_element_type, config, bwd_config);
  const RaggedDotShape shape = ShapeOf(lhs, group_sizes, sig);
  // A gradient product runs as a ragged_dot call of its own: to that call it is the forward product.
  const RaggedDotConfig resolved = ConfigOrHeuristic<&RaggedDotHeuristicConfig>(
      sig.configs.forward, shape, ToCoreDType(lhs.scalar_type(), "ragged_dot"), RaggedDotProduct::kForward);
  const std::vector<int64_t> sizes = GroupSizesToVector(group_sizes);
  const Status sizes_status = CheckRaggedDotGroupSizes(sizes.data(), shape.g, shape.m);
  TORCH_CHECK(sizes_status.ok(), sizes_status.message());

  Tensor out = EmptyOutput(lhs, sig);
  RaggedDotParams params;
  params.form = sig.form;
  params.lhs = StridedViewOf<3>(lhs, "ragged_dot");
  params.rhs = StridedViewOf<3>(rhs, "ragged_dot");
  params.group_sizes = sizes.data();
  params.num_groups = shape.g;
  params.out = out.data_ptr();
  params.out_dtype = ToCoreDType(sig.out_dtype, "ragged_dot");
  for (int64_t d = 0; d < out.dim(); ++d) params.out_strides[d] = out.stride(d);
  const Status status = RaggedDot(params, resolved);
  TORCH_CHECK(status.ok(), status.message());
  return out;
}

// ---- the reference: plain ATen ops, fp32 accumulation ------------------------------------------

Tensor RaggedDotReferenceImpl(const Tensor& lhs, const Tensor& rhs, const Tensor& group_sizes,
                              at::OptionalIntArrayRef dimension_numbers,
                              std::optional<at::ScalarType> preferred_element_type, at::OptionalIntArrayRef config,
                              at::OptionalIntArrayRef bwd_config) {
  const RaggedDotSignature sig =
      CheckRaggedDotArgs(lhs, rhs, group_sizes, dimension_numbers, preferred_element_type, config, bwd_config);
  const std::vector<int64_t> sizes = GroupSizesToVector(group_sizes);
  const Status sizes_status = CheckRaggedDotGroupSizes(sizes.data(), group_sizes.size(0), lhs.size(0));
  TORCH_CHECK(sizes_status.ok(), sizes_status.message());
  const at::ScalarType acc_type = lhs.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor lhs32 = lhs.to(acc_type);
  const Tensor rhs32 = rhs.to(acc_type);
  Tensor out = at::zeros_symint(sig.out_shape, lhs.options().dtype(acc_type));
  int64_t start = 0;
  for (int64_t g = 0; g < static_cast<int64_t>(sizes.size()); ++g) {
    const int64_t rows = sizes[g];
    const Tensor lhs_rows = lhs32.narrow(0, start, rows);
    switch (sig.form) {
      case RaggedDotForm::kDefault:
        out.narrow(0, start, rows).copy_(at::mm(lhs_rows, rhs32[g]));
        break;
      case RaggedDotForm::kTransRhs:
        out.narrow(0, start, rows).copy_(at::mm(lhs_rows, rhs32[g].t()));
        break;
      case RaggedDotForm::kRaggedContracting:
        out[g].copy_(at::mm(lhs_rows.t(), rhs32.narrow(0, start, rows)));
        break;
    }
    start += rows;
  }
  return out.to(sig.out_dtype);
}

Tensor RaggedDotMeta(const Tensor& lhs, const Tensor& rhs, const Tensor& group_sizes,
                     at::OptionalIntArrayRef dimension_numbers, std::optional<at::ScalarType> preferred_element_type,
                     at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  return EmptyOutput(lhs, CheckRaggedDotArgs(lhs, rhs, group_sizes, dimension_numbers, preferred_element_type,
                                             config, bwd_config));
}

// ---- autograd ----------------------------------------------------------------------------------

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, at::OptionalIntArrayRef,
                                      std::optional<at::ScalarType>, at::OptionalIntArrayRef,
                                      at::OptionalIntArrayRef)>&
RaggedDotOp(bool reference) {
  using Signature = Tensor(const Tensor&, const Tensor&, const Tensor&, at::OptionalIntArrayRef,
                           std::optional<at::ScalarType>, at::OptionalIntArrayRef, at::OptionalIntArrayRef);
  static const auto kernel =
      c10::Dispatcher::singleton().findSchemaOrThrow("tokamax::ragged_dot", "").typed<Signature>();
  static const auto ref =
      c10::Dispatcher::singleton().findSchemaOrThrow("tokamax::ragged_dot_reference", "").typed<Signature>();
  return reference ? ref : kernel;
}

Tensor CallRaggedDot(bool reference, const Tensor& lhs, const Tensor& rhs, const Tensor& group_sizes,
                     RaggedDotForm form, at::ScalarType out_dtype, const std::vector<int64_t>& config,
                     RaggedDotProduct product) {
  const RecordedProductScope recorded(RaggedDotConfig::kProductNames[static_cast<int>(product)]);
  const std::vector<int64_t> dims = RaggedDotDimensionNumbers(form);
  at::OptionalIntArrayRef config_ref;
  if (!config.empty()) config_ref = at::IntArrayRef(config);
  return RaggedDotOp(reference).call(lhs, rhs, group_sizes, at::IntArrayRef(dims), out_dtype, config_ref, config_ref);
}

// Gradients of every form are products of the other forms (per group g, with rows r):
//   DEFAULT   out = L·R[g]      dL = TRANS_RHS(dout, R)      dR = RAGGED_CONTRACTING(L, dout)
//   TRANS_RHS out = L·R[g]ᵀ     dL = DEFAULT(dout, R)        dR = RAGGED_CONTRACTING(dout, L)
//   RAGGED_C. out[g] = L_rᵀ·R_r dL = TRANS_RHS(R, dout)      dR = DEFAULT(L, dout)
// so the backward runs the same registered op, and higher derivatives work too.
class RaggedDotFunction : public torch::autograd::Function<RaggedDotFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& lhs, const Tensor& rhs, const Tensor& group_sizes,
                        at::OptionalIntArrayRef dimension_numbers,
                        std::optional<at::ScalarType> preferred_element_type, at::OptionalIntArrayRef config,
                        at::OptionalIntArrayRef bwd_config, bool reference) {
    const RaggedDotSignature sig =
        CheckRaggedDotArgs(lhs, rhs, group_sizes, dimension_numbers, preferred_element_type, config, bwd_config);
    ctx->saved_data["form"] = static_cast<int64_t>(sig.form);
    ctx->saved_data["reference"] = reference;
    // Empty: that product uses the heuristic for its own shape (what get_configs returns).
    auto values = [](const std::optional<RaggedDotConfig>& c) { return c ? c->ToVector() : std::vector<int64_t>{}; };
    ctx->saved_data["dlhs_config"] = values(sig.configs.dlhs);
    ctx->saved_data["drhs_config"] = values(sig.configs.drhs);
    ctx->save_for_backward({lhs, rhs, group_sizes});
    at::AutoDispatchBelowADInplaceOrView guard;
    return RaggedDotOp(reference).call(lhs, rhs, group_sizes, dimension_numbers, preferred_element_type, config,
                                       bwd_config);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& lhs = saved[0];
    const Tensor& rhs = saved[1];
    const Tensor& group_sizes = saved[2];
    const auto form = static_cast<RaggedDotForm>(ctx->saved_data["form"].toInt());
    const bool reference = ctx->saved_data["reference"].toBool();
    const std::vector<int64_t> dlhs_config = ctx->saved_data["dlhs_config"].toIntVector();
    const std::vector<int64_t> drhs_config = ctx->saved_data["drhs_config"].toIntVector();
    // The cotangent is taken in the inputs' dtype (e.g. an fp32 cotangent of a bf16 product
    // with preferred_element_type=float32 is rounded to bf16), as in mixed-precision training.
    const Tensor dout = grad_outputs[0].to(lhs.scalar_type());
    Tensor dlhs, drhs;
    const bool want_lhs = ctx->needs_input_grad(0), want_rhs = ctx->needs_input_grad(1);
    switch (form) {
      case RaggedDotForm::kDefault:
        if (want_lhs) dlhs = CallRaggedDot(reference, dout, rhs, group_sizes, RaggedDotForm::kTransRhs, lhs.scalar_type(), dlhs_config, RaggedDotProduct::kDlhs);
        if (want_rhs) drhs = CallRaggedDot(reference, lhs, dout, group_sizes, RaggedDotForm::kRaggedContracting, rhs.scalar_type(), drhs_config, RaggedDotProduct::kDrhs);
        break;
      case RaggedDotForm::kTransRhs:
        if (want_lhs) dlhs = CallRaggedDot(reference, dout, rhs, group_sizes, RaggedDotForm::kDefault, lhs.scalar_type(), dlhs_config, RaggedDotProduct::kDlhs);
        if (want_rhs) drhs = CallRaggedDot(reference, dout, lhs, group_sizes, RaggedDotForm::kRaggedContracting, rhs.scalar_type(), drhs_config, RaggedDotProduct::kDrhs);
        break;
      case RaggedDotForm::kRaggedContracting:
        if (want_lhs) dlhs = CallRaggedDot(reference, rhs, dout, group_sizes, RaggedDotForm::kTransRhs, lhs.scalar_type(), dlhs_config, RaggedDotProduct::kDlhs);
        if (want_rhs) drhs = CallRaggedDot(reference, lhs, dout, group_sizes, RaggedDotForm::kDefault, rhs.scalar_type(), drhs_config, RaggedDotProduct::kDrhs);
        break;
    }
    return {dlhs, drhs, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

template <bool kReference>
Tensor RaggedDotAutograd(const Tensor& lhs, const Tensor& rhs, const Tensor& group_sizes,
                         at::OptionalIntArrayRef dimension_numbers, std::optional<at::ScalarType> preferred_element_type,
                         at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  CheckNoFunctorchTransform(kReference ? "ragged_dot_reference" : "ragged_dot");
  return RaggedDotFunction::apply(lhs, rhs, group_sizes, dimension_numbers, preferred_element_type, config,
                                  bwd_config, kReference);
}

// ---- configs for Python: the helper ops' problem (op_kit.h) ------------------------------------

// The call whose configs get_configs / config_space ask for.
ConfigProblem<RaggedDotShape> RaggedDotConfigProblem(const Tensor& lhs, const Tensor& rhs, const Tensor& group_sizes,
                                                     at::OptionalIntArrayRef dimension_numbers,
                                                     std::optional<at::ScalarType> preferred_element_type) {
  const RaggedDotSignature sig = CheckRaggedDotArgs(lhs, rhs, group_sizes, dimension_numbers, preferred_element_type);
  return {ShapeOf(lhs, group_sizes, sig), ToCoreDType(lhs.scalar_type(), "ragged_dot")};
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_RAGGED_DOT_ARGS                                                                     \
  "(Tensor lhs, Tensor rhs, Tensor group_sizes, int[]? ragged_dot_dimension_numbers=None, "        \
  "ScalarType? preferred_element_type=None, int[]? config=None, int[]? bwd_config=None) -> Tensor"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("ragged_dot" TOKAMAX_RAGGED_DOT_ARGS);
  m.def("ragged_dot_reference" TOKAMAX_RAGGED_DOT_ARGS);
  tokamax::DefineConfigOps<&tokamax::RaggedDotConfigProblem, &tokamax::RaggedDotHeuristicConfig,
                           &tokamax::RaggedDotConfigSpace>(
      m, "Tensor lhs, Tensor rhs, Tensor group_sizes, int[]? ragged_dot_dimension_numbers=None, "
         "ScalarType? preferred_element_type=None");
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("ragged_dot", &tokamax::RaggedDotCpu);
}

TORCH_LIBRARY_IMPL(tokamax, CompositeExplicitAutograd, m) {
  m.impl("ragged_dot_reference", &tokamax::RaggedDotReferenceImpl);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("ragged_dot", &tokamax::RaggedDotMeta);
  m.impl("ragged_dot_reference", &tokamax::RaggedDotMeta);
}

TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("ragged_dot", &tokamax::RaggedDotAutograd<false>);
  m.impl("ragged_dot_reference", &tokamax::RaggedDotAutograd<true>);
}

TORCH_LIBRARY_IMPL(tokamax, AutocastCPU, m) {
  tokamax::RegisterLowerPrecisionAutocast(m, {"ragged_dot", "ragged_dot_reference"});
}
