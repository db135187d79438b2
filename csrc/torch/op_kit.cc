// The config recorder of op_kit.h and its two private ops; the two boxed autocast kernels.
#include "csrc/torch/op_kit.h"

#include <ATen/FuncTorchTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>
#include <map>
#include <mutex>
#include <utility>

namespace tokamax {
namespace {

std::atomic<bool> recorder_enabled{false};
std::mutex recorder_mutex;
std::vector<ConfigRecord>& Records() {
  static std::vector<ConfigRecord> records;  // guarded by recorder_mutex
  return records;
}
thread_local const char* scoped_product = nullptr;

// Turns the recorder on or off; either way drops what it held.
void SetConfigRecorder(bool enabled) {
  std::lock_guard<std::mutex> lock(recorder_mutex);
  Records().clear();
  recorder_enabled.store(enabled, std::memory_order_relaxed);
}

// The records since the last call (and drops them): ops, products, each config's length, the
// configs concatenated, and 1 where the caller gave the config, 0 where the heuristic chose it.
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>,
           std::vector<int64_t>>
DrainConfigRecords() {
  std::vector<ConfigRecord> records;
  {
    std::lock_guard<std::mutex> lock(recorder_mutex);
    records.swap(Records());
  }
  std::vector<std::string> ops, products;
  std::vector<int64_t> sizes, values, given;
  for (const ConfigRecord& r : records) {
    ops.push_back(r.op);
    products.push_back(r.product);
    sizes.push_back(static_cast<int64_t>(r.config.size()));
    values.insert(values.end(), r.config.begin(), r.config.end());
    given.push_back(r.given ? 1 : 0);
  }
  return {ops, products, sizes, values, given};
}

}  // namespace

bool ConfigRecorderEnabled() { return recorder_enabled.load(std::memory_order_relaxed); }

void RecordConfig(ConfigRecord record) {
  std::lock_guard<std::mutex> lock(recorder_mutex);
  if (recorder_enabled.load(std::memory_order_relaxed)) Records().push_back(std::move(record));
}

RecordedProductScope::RecordedProductScope(const char* product) : previous_(scoped_product) {
  scoped_product = product;
}
RecordedProductScope::~RecordedProductScope() { scoped_product = previous_; }
const char* RecordedProductScope::Current() { return scoped_product; }

namespace {

constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;  // the AutocastCPU key's kernels

// The boxed autocast kernel: casts the call's floating input tensors on the stack to the autocast
// dtype, then calls the op again with autocast excluded (the next kernel is the op's Autograd one).
void LowerPrecisionAutocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const std::vector<c10::Argument>& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::AliasInfo* alias = arguments[i].alias_info();
    if (alias != nullptr && alias->isWrite()) continue;
    c10::IValue& value = (*stack)[first + i];
    if (value.isTensor()) {
      value = at::autocast::cached_cast(dtype, value.toTensor(), kDevice);
    } else if (value.isTensorList()) {
      value = at::autocast::cached_cast(dtype, value.toTensorVector(), kDevice);
    }
  }
  op.callBoxed(stack);
}

// The op, and every op it calls, with autocast off.
void InputDtypeAutocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  op.callBoxed(stack);
}

}  // namespace

void RegisterLowerPrecisionAutocast(torch::Library& m, std::initializer_list<const char*> ops) {
  for (const char* name : ops) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&LowerPrecisionAutocast>());
}

void RegisterInputDtypeAutocast(torch::Library& m, std::initializer_list<const char*> ops) {
  for (const char* name : ops) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&InputDtypeAutocast>());
}

bool UnderFunctorchDifferentiation() {
  const auto& functorch = at::functorch::functorchTLSAccessor();
  if (!functorch) return false;  // no transform has run on this thread
  // PyTorch's own check (ATen/functorch's layer stack is not in the installed headers).
  try {
    functorch->checkSupportsCppAutogradFunction();
  } catch (const c10::Error&) {
    return true;
  }
  return false;
}

void CheckNoFunctorchTransform(const char* op) {
  TORCH_CHECK(!UnderFunctorchDifferentiation(), "tokamax::", op,
              ": torch.func transforms that differentiate (grad, vjp, jacrev, jacfwd, jvp, hessian) cannot run this "
              "op: its backward is a C++ autograd function, which PyTorch runs under torch.autograd only. "
              "Differentiate with loss.backward() or torch.autograd.grad; torch.vmap without them works.");
}

namespace op_kit_detail {

const c10::OperatorHandle& ReferenceInsteadOfFunction(const char* op) {
  static std::mutex mutex;
  static std::map<std::string, c10::OperatorHandle> handles;
  const std::lock_guard<std::mutex> lock(mutex);
  auto found = handles.find(op);
  if (found == handles.end()) {  // the op's first such call: warn once per op
    TORCH_WARN("tokamax::", op, " runs its reference (plain ATen ops) under torch.func's differentiating ",
               "transforms and in forward-mode AD: its kernel's autograd is a C++ autograd function, which serves ",
               "torch.autograd's backward only. Results are the reference's, at its speed.");
    const std::string name = std::string("tokamax::") + op + "_reference";
    found = handles.emplace(op, c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "")).first;
  }
  return found->second;
}

}  // namespace op_kit_detail

}  // namespace tokamax

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("_record_configs(bool enabled) -> ()", &tokamax::SetConfigRecorder);
  m.def("_recorded_configs() -> (str[] ops, str[] products, int[] sizes, int[] values, int[] given)",
        &tokamax::DrainConfigRecords);
}
