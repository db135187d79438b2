// The config plumbing every op adapter shares, generic over the op's Config (a struct written
// with TOKAMAX_CONFIG_BODY, csrc/core/base/config_fields.h): parsing the schema's int[] configs,
// picking the heuristic when none is given, and the four config helper ops Python builds its
// Config classes and the autotuner from. Adapter-only (sees torch).
//
// An op registers its helper ops with one call in its TORCH_LIBRARY_FRAGMENT:
//
//   ConfigProblem<MyOpShape> MyOpConfigProblem(const Tensor& x, bool flag);  // checks, shape, dtype
//   DefineConfigOps<&MyOpConfigProblem, &MyOpHeuristicConfig, &MyOpConfigSpace>(m, "Tensor x, bool flag=False");
//
// which defines, for the Config's kOpName `my_op`:
//   _my_op_config_fields() -> (str[] names, str[] docs, str[] products)
//   _my_op_validate_config(int[] config) -> ()
//   _my_op_heuristic_config(Tensor x, bool flag=False, int product=0) -> int[]
//   _my_op_config_space(Tensor x, bool flag=False, int product=0) -> int[]   (configs concatenated)
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "csrc/core/base/config_fields.h"
#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/base/dtype.h"
#include "csrc/torch/adapter_utils.h"

namespace tokamax {

// `values`, the schema's int[] argument `argument`, as a validated Config. The error names the
// op, the argument, the field, the expected range and the value got.
template <typename Config>
Config ParseConfig(at::IntArrayRef values, const char* argument) {
  Config parsed;
  const Status status = Config::FromVector(values.vec(), &parsed);
  TORCH_CHECK(status.ok(), Config::kOpName, ": ", argument, ": ", status.message());
  return parsed;
}

template <typename Config>
std::optional<Config> ParseOptionalConfig(at::OptionalIntArrayRef values, const char* argument) {
  if (!values.has_value()) return std::nullopt;
  return ParseConfig<Config>(*values, argument);
}

// The schema's `int product` (an index into Config::kProductNames) as the Config's Product.
template <typename Config>
typename Config::Product ParseProduct(int64_t product) {
  if (product >= 0 && product < Config::kNumProducts) return static_cast<typename Config::Product>(product);
  std::string expected;
  for (int i = 0; i < Config::kNumProducts; ++i) {
    expected += (i == 0 ? "" : i + 1 == Config::kNumProducts ? " or " : ", ") + std::to_string(i) + " (" +
                Config::kProductNames[i] + ")";
  }
  TORCH_CHECK(false, Config::kOpName, ": product must be ", expected, ", got ", product);
}

// ---- autocast ---------------------------------------------------------------------------------
//
// The ops built on matrix products (ragged_dot, dot_product_attention, gated_linear_unit,
// linear_softmax_cross_entropy_loss, fused_experts, fused_moe: kernel and reference alike) follow
// PyTorch's "lower precision" autocast policy, as torch.mm and scaled_dot_product_attention do:
// inside torch.autocast(device, dtype), every floating input tensor (a tensor list's too) is cast
// to the autocast dtype before the op runs, so fp32 weights and bf16 activations meet in bf16 and
// gradients flow back to the fp32 tensors through the casts. An argument the op writes in place
// (`Tensor(a!)`) is never cast: a copy would take the write. The other ops run in their inputs'
// dtypes: autocast's default fall-through where the kernel and the reference both are opaque to
// it, RegisterInputDtypeAutocast where a reference made of ATen ops would otherwise have its
// matrix products cast inside it (ragged_paged_attention's) and so disagree with the kernel.
// Registered per op family with one call:
//
//   TORCH_LIBRARY_IMPL(tokamax, AutocastCPU, m) { RegisterLowerPrecisionAutocast(m, {"my_op", "my_op_reference"}); }
void RegisterLowerPrecisionAutocast(torch::Library& m, std::initializer_list<const char*> ops);
void RegisterInputDtypeAutocast(torch::Library& m, std::initializer_list<const char*> ops);

// torch.func's transforms that differentiate (grad, vjp, jacrev, jacfwd, jvp, hessian) run an
// op's Autograd kernel inside their own layer, where PyTorch refuses a C++
// torch::autograd::Function (docs/design.md, "torch.vmap and torch.func").
// UnderFunctorchDifferentiation: PyTorch's own test for that refusal.
bool UnderFunctorchDifferentiation();

// The refusal, naming the op: for an op whose reference cannot stand in (ragged_dot's reference
// is a C++ Function too). Called by the Autograd kernel before its Function::apply.
void CheckNoFunctorchTransform(const char* op);

namespace op_kit_detail {
const c10::OperatorHandle& ReferenceInsteadOfFunction(const char* op);  // warns once per op

template <typename T>
bool ArgumentHasTangent(const T& argument) {
  if constexpr (std::is_same_v<T, at::Tensor> || std::is_same_v<T, std::optional<at::Tensor>>) {
    return HasTangent(argument);
  } else {
    return false;
  }
}

template <typename Result>
Result ResultsFromStack(torch::jit::Stack& stack) {
  if constexpr (std::is_same_v<Result, at::Tensor>) {
    return stack.at(0).toTensor();
  } else {
    return [&]<size_t... I>(std::index_sequence<I...>) {
      return Result{stack.at(I).toTensor()...};
    }(std::make_index_sequence<std::tuple_size_v<Result>>());
  }
}
}  // namespace op_kit_detail

// Where the C++ Function cannot serve a call, a kernel whose reference is made of ATen ops runs
// the reference instead (`tokamax::<op>_reference`, the same schema): under torch.func's
// differentiating transforms, and in forward mode (an input carrying a tangent, which the Function
// refuses). torch.func and forward-mode AD differentiate the reference like any ATen code: the
// reference's results, within the op's tolerance of the kernel's, at the reference's speed (a
// warning, once per op, says so). Each such op's Autograd kernel calls this before its
// Function::apply with the call's schema arguments in order; nullopt where the Function serves.
template <typename Result, typename... Args>
std::optional<Result> RunReferenceWhereFunctionCannot(const char* op, const Args&... args) {
  if (!UnderFunctorchDifferentiation() && !(op_kit_detail::ArgumentHasTangent(args) || ...)) return std::nullopt;
  torch::jit::Stack stack;
  stack.reserve(sizeof...(Args));
  (stack.emplace_back(args), ...);
  op_kit_detail::ReferenceInsteadOfFunction(op).callBoxed(&stack);
  return op_kit_detail::ResultsFromStack<Result>(stack);
}

// ---- the config recorder: which config each kernel call ran with ------------------------------
//
// Off unless a test turns it on (tokamax_torch._op.record_configs()): then every kernel call that
// resolves its config through ConfigOrHeuristic appends (op, product, config, given) here, so
// "an explicit config is honoured" and "configs=None runs the heuristic" are observed, not
// inferred from bits. Process-wide; the ops _record_configs / _recorded_configs (op_kit.cc)
// switch it and drain it. Off, a call pays one relaxed atomic load.
struct ConfigRecord {
  std::string op;
  std::string product;
  std::vector<int64_t> config;
  bool given;  // the caller's config (true) or the heuristic's (false)
};
bool ConfigRecorderEnabled();
void RecordConfig(ConfigRecord record);

// Names the product of the kernel calls made in its scope (this thread), for an op whose
// backward product runs as another call of the op (ragged_dot's gradients are ragged_dot calls,
// each resolving its config as that call's forward). `product` must outlive the scope.
class RecordedProductScope {
 public:
  explicit RecordedProductScope(const char* product);
  ~RecordedProductScope();
  RecordedProductScope(const RecordedProductScope&) = delete;
  RecordedProductScope& operator=(const RecordedProductScope&) = delete;
  static const char* Current();  // null outside any scope

 private:
  const char* previous_;
};

// The config a kernel runs with: the caller's when given, else the heuristic's for this call.
// Every kernel resolves its config here, which is where the recorder sees it.
template <auto kHeuristic, typename Config, typename Shape>
Config ConfigOrHeuristic(const std::optional<Config>& config, const Shape& shape, DType dtype,
                         typename Config::Product product) {
  Config resolved = config.has_value() ? *config : kHeuristic(shape, dtype, GetCpuInfo(), product);
  if (ConfigRecorderEnabled()) {
    const char* scoped = RecordedProductScope::Current();
    RecordConfig({Config::kOpName, scoped != nullptr ? scoped : Config::kProductNames[static_cast<int>(product)],
                  resolved.ToVector(), config.has_value()});
  }
  return resolved;
}

// What an op's config problem function derives from the helper ops' arguments.
template <typename Shape>
struct ConfigProblem {
  Shape shape;
  DType dtype;
};

// A config is chosen for concrete sizes (the heuristic, the search space and the cache key all
// read them): traced with symbolic ones, say so instead of failing in SymInt::expect_int.
inline void RequireConcreteShape(const char* op, const at::Tensor& t) {
  for (const c10::SymInt& size : t.sym_sizes()) {
    TORCH_CHECK(size.maybe_as_int().has_value(), op,
                ": configs are chosen for concrete shapes; call get_configs / config_space outside "
                "torch.compile and torch.export (the op itself picks its config inside them)");
  }
}
inline void RequireConcreteShape(const char* op, const std::optional<at::Tensor>& t) {
  if (t.has_value()) RequireConcreteShape(op, *t);
}
template <typename NotATensor>
void RequireConcreteShape(const char*, const NotATensor&) {}

namespace op_kit_detail {

template <typename Fn>
struct ReturnOf;
template <typename R, typename... Args>
struct ReturnOf<R (*)(Args...)> {
  using type = R;
};

template <auto kProblem, auto kHeuristic, auto kSpace, typename ProblemFn = decltype(kProblem)>
struct ConfigOps;

template <auto kProblem, auto kHeuristic, auto kSpace, typename Shape, typename... Args>
struct ConfigOps<kProblem, kHeuristic, kSpace, ConfigProblem<Shape> (*)(Args...)> {
  using Config = typename ReturnOf<decltype(kHeuristic)>::type;

  static ConfigProblem<Shape> Problem(const Args&... args) {
    (RequireConcreteShape(Config::kOpName, args), ...);
    return kProblem(args...);
  }

  static std::vector<int64_t> Heuristic(Args... args, int64_t product) {
    const typename Config::Product parsed = ParseProduct<Config>(product);
    const ConfigProblem<Shape> problem = Problem(args...);
    return kHeuristic(problem.shape, problem.dtype, GetCpuInfo(), parsed).ToVector();
  }

  static std::vector<int64_t> Space(Args... args, int64_t product) {
    const typename Config::Product parsed = ParseProduct<Config>(product);
    const ConfigProblem<Shape> problem = Problem(args...);
    std::vector<int64_t> flat;
    for (const Config& config : kSpace(problem.shape, problem.dtype, GetCpuInfo(), parsed)) {
      const std::vector<int64_t> values = config.ToVector();
      flat.insert(flat.end(), values.begin(), values.end());
    }
    return flat;
  }

  static std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>> Fields() {
    std::vector<std::string> names, docs;
    for (const ConfigField& field : Config::kFields) {
      names.push_back(field.name);
      docs.push_back(std::string(field.doc) + " (" + ConfigFieldRange(field) + ")");
    }
    return {names, docs, std::vector<std::string>(Config::kProductNames.begin(), Config::kProductNames.end())};
  }

  static void Validate(at::IntArrayRef config) {
    Config parsed;
    const Status status = Config::FromVector(config.vec(), &parsed);
    TORCH_CHECK(status.ok(), status.message());
  }
};

}  // namespace op_kit_detail

// Defines the four config helper ops of an op (see the top of this file). `problem_args` is the
// schema of `kProblem`'s arguments; the heuristic and space ops take them and then `int product=0`.
// The heuristic and space ops run outside autograd (CompositeExplicitAutograd), on real or meta
// tensors with concrete shapes.
template <auto kProblem, auto kHeuristic, auto kSpace>
void DefineConfigOps(torch::Library& m, const std::string& problem_args) {
  using Ops = op_kit_detail::ConfigOps<kProblem, kHeuristic, kSpace>;
  const std::string prefix = std::string("_") + Ops::Config::kOpName;
  const std::string query = "(" + problem_args + ", int product=0) -> int[]";
  m.def((prefix + "_config_fields() -> (str[] names, str[] docs, str[] products)").c_str(), &Ops::Fields);
  m.def((prefix + "_validate_config(int[] config) -> ()").c_str(), &Ops::Validate);
  m.def((prefix + "_heuristic_config" + query).c_str());
  m.def((prefix + "_config_space" + query).c_str());
  m.impl((prefix + "_heuristic_config").c_str(),
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &Ops::Heuristic));
  m.impl((prefix + "_config_space").c_str(), torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &Ops::Space));
}

}  // namespace tokamax
