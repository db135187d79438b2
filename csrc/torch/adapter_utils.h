// Small helpers every op adapter shares: dtype mapping, shape strings for error messages and
// the allocation of outputs. Adapter-only (sees torch).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <initializer_list>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "csrc/core/base/dtype.h"
#include "csrc/core/base/strided_view.h"

namespace tokamax {

inline std::string ShapeString(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sym_sizes();
  return out.str();
}

inline bool IsSupportedFloat(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf || type == at::kDouble;
}

inline DType ToCoreDType(at::ScalarType type, const char* op) {
  switch (type) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    case at::kDouble: return DType::kFloat64;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", type);
  }
}

// `t` as the core's view of it, no copy: its data, dtype, sizes and strides (in elements). A
// tensor of fewer than N dims fills the leading ones; the rest stay size 0, stride 0 (the core
// reads only the dims its params say the tensor has, as ragged_dot's 2-D lhs).
template <int N, typename Pointer = const void*>
StridedView<N, Pointer> StridedViewOf(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.dim() <= N, op, ": a ", t.dim(), "-D tensor has no ", N, "-D view");  // internal: args are checked
  StridedView<N, Pointer> view;
  if constexpr (std::is_same_v<Pointer, void*>) {
    view.data = t.data_ptr();
  } else {
    view.data = t.const_data_ptr();
  }
  view.dtype = ToCoreDType(t.scalar_type(), op);
  for (int64_t d = 0; d < t.dim(); ++d) {
    view.sizes[d] = t.size(d);
    view.strides[d] = t.stride(d);
  }
  return view;
}

// The same, writable: for a tensor the kernel writes.
template <int N>
MutableStridedView<N> MutableStridedViewOf(const at::Tensor& t, const char* op) {
  return StridedViewOf<N, void*>(t, op);
}

// ---- outputs: the one way adapters create the tensors a kernel writes -------------------------
//
// Above LargeBufferBytes::kMapThreshold (1 MiB) an output's storage is a LargeBufferBytes
// (csrc/core/runtime/large_buffer.h): 2 MiB-aligned, advised for huge pages, and when the tensor
// is freed its mapping goes to the process-wide cache, so the next call's output of about the
// same size is already faulted in (glibc unmaps freed blocks over 32 MiB: each call paid ~10 ms of
// page faults per 32 MiB). Smaller outputs, and all of them when the cache limit is 0, come from
// torch's CPU allocator. Uninitialised (a reused mapping holds an earlier tensor's values): the
// kernel writes every element. The storage is resizable (resize_ allocates through the same
// allocator). Non-CPU devices (Meta) and symbolic sizes fall back to at::empty/at::zeros.
// docs/design.md, "Pooled outputs".
at::Tensor NewOutputSymint(c10::SymIntArrayRef sizes, const at::TensorOptions& options);
inline at::Tensor NewOutput(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return NewOutputSymint(c10::fromIntArrayRefSlow(sizes), options);
}
// Zero-filled (a fresh mapping is zero already; a reused one is cleared with memset).
at::Tensor NewZeroedOutputSymint(c10::SymIntArrayRef sizes, const at::TensorOptions& options);
inline at::Tensor NewZeroedOutput(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return NewZeroedOutputSymint(c10::fromIntArrayRefSlow(sizes), options);
}
// at::empty_like(t): t's strides when t is dense and non-overlapping (a transposed view gets a
// transposed output), else contiguous; in `dtype` when given.
at::Tensor NewOutputLike(const at::Tensor& t, std::optional<at::ScalarType> dtype = std::nullopt);

// Rows `indices` of a 2-D x where `keep`, zero rows elsewhere, in plain ATen ops for the
// references: a dropped entry reads a zero row appended to x, not one of x's own (its index may be
// anything, x may have no rows at all, and a NaN in x must reach neither the result nor the
// gradients of a dropped entry).
inline at::Tensor GatherRowsOrZero(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& keep) {
  const at::Tensor padded = at::cat({x, at::zeros_symint({1, x.sym_size(1)}, x.options())});
  return padded.index_select(0, at::where(keep, indices.to(at::kLong), at::Scalar(x.sym_size(0))));
}

// A dense CPU tensor outside any tracing (no fake, functional or Python-subclass wrapper): the
// only case where a backward may write over a saved tensor. Traced graphs (torch.compile) keep
// the functional op, whose memory the compiler plans.
inline bool IsPlainCpu(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided &&
         !t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                                   c10::DispatchKey::PythonTLSSnapshot})) &&
         !t.unsafeGetTensorImpl()->is_python_dispatch();
}

// Whether a weight's columns (its last dim) are contiguous, so a GEMM of few rows can read it in
// place rather than pack it: the heuristics' `weights_in_place` (fused [K, 2, N] or [E, H, 2I]
// weights are; nn.Linear's transposed views are not).
inline bool ColumnsContiguous(const at::Tensor& w) { return w.size(-1) <= 1 || w.stride(-1) == 1; }

// Whether a backward can follow this call: grad mode on and an input requiring grad. Adapters
// decide before their autograd Function (inside it grad mode is always off), so a call under
// no_grad whose parameters still require grad (generation) runs the plain forward and saves
// nothing for a backward that never comes. Undefined tensors (absent optionals) count as not
// requiring grad.
inline bool WillBackward(std::initializer_list<const at::Tensor*> tensors,
                         std::initializer_list<const std::optional<at::Tensor>*> optional = {}) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : tensors) {
    if (t->defined() && t->requires_grad()) return true;
  }
  for (const std::optional<at::Tensor>* t : optional) {
    if (t->has_value() && (*t)->defined() && (*t)->requires_grad()) return true;
  }
  return false;
}

// Whether a tensor argument carries a forward-mode tangent (torch.func.jvp, forward_ad).
inline bool HasTangent(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }
inline bool HasTangent(const std::optional<at::Tensor>& t) { return t.has_value() && HasTangent(*t); }

// Whether a call must go through its autograd Function rather than run the plain op below
// autograd: a backward can follow (WillBackward), or an input carries a forward-mode tangent
// (torch.func.jvp, torch.autograd.forward_ad). The Function refuses forward mode loudly; the
// plain op would drop the tangent and give a zero one silently.
inline bool NeedsAutogradFunction(std::initializer_list<const at::Tensor*> tensors,
                                  std::initializer_list<const std::optional<at::Tensor>*> optional = {}) {
  if (WillBackward(tensors, optional)) return true;
  return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor* t) { return HasTangent(*t); }) ||
         std::any_of(optional.begin(), optional.end(), [](const std::optional<at::Tensor>* t) { return HasTangent(*t); });
}

// The Autograd kernel of an op without a gradient (upstream defines none), boxed so one function
// serves every such op: it runs the op below autograd, so its outputs never require grad, the
// kernel's and the reference's alike (a CompositeExplicitAutograd reference would otherwise
// record its ATen ops). Register with torch::CppFunction::makeFromBoxedFunction<&RunBelowAutograd>().
inline void RunBelowAutograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  at::AutoDispatchBelowADInplaceOrView guard;
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

// ---- donated buffers: the one check every op that writes an input in place makes ---------------
//
// A donated input is written in place and returned (docs/design.md, "Buffer donation"). Before
// any write: the donated tensor must not overlap itself (a stride-0 or overlapping view would
// make the result depend on the write order; checked in Meta kernels too where strides are
// concrete, so torch.compile raises this message rather than Inductor's), and no other argument
// may share memory with it (the kernel would read what it has already overwritten; real tensors
// only: Meta kernels cannot see addresses, and the CPU kernel runs this check at run time under
// torch.compile too).

// The byte range [first, last) a tensor's elements span in its storage.
inline std::pair<int64_t, int64_t> StorageByteRange(const at::Tensor& t) {
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {t.storage_offset() * t.element_size(), (last + 1) * t.element_size()};
}

// Sufficient for no self-overlap: with dims sorted by stride, each stride covers the extent of
// the ones below it (the test of dense and of padded layouts alike).
inline bool CertainlyNonOverlapping(const at::Tensor& t) {
  if (t.numel() <= 1) return true;
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end(), [&](int64_t a, int64_t b) { return t.stride(a) < t.stride(b); });
  int64_t extent = 1;  // elements spanned by the dims placed so far
  for (int64_t d : dims) {
    if (t.stride(d) < extent) return false;
    extent = t.stride(d) * (t.size(d) - 1) + extent;
  }
  return true;
}

inline void CheckDonatedBuffer(const char* op, const char* donated_name, const at::Tensor& donated,
                               std::initializer_list<std::pair<const char*, const at::Tensor*>> others) {
  if (donated.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return;
  if (donated.numel() == 0) return;
  TORCH_CHECK(CertainlyNonOverlapping(donated), op, ": ", donated_name,
              " is written in place and must not overlap itself, got shape ", donated.sizes(), " with strides ",
              donated.strides());
  if (donated.is_meta()) return;
  const auto range = StorageByteRange(donated);
  for (const auto& [name, other] : others) {
    if (other->is_meta() || other->numel() == 0 || !other->has_storage()) continue;
    if (!other->storage().is_alias_of(donated.storage())) continue;
    const auto other_range = StorageByteRange(*other);
    TORCH_CHECK(other_range.second <= range.first || range.second <= other_range.first, op, ": ", name,
                " must not share memory with ", donated_name, ", which the op writes in place (donated)");
  }
}

}  // namespace tokamax
