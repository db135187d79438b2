// Small helpers every op adapter shares: dtype mapping, shape strings for error messages and
// huge-page advice for fresh outputs. Adapter-only (sees torch).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <sys/mman.h>

#include <sstream>
#include <string>
#include <type_traits>

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

// A fresh multi-MiB output is first touched by the kernel, and 4 KiB page faults cost ~10 ms
// per 32 MiB here (~15% of an 8192x1024x1024 ragged_dot). Asking for transparent huge pages
// on its 2 MiB-aligned interior (Linux, THP "madvise" mode) cuts the fault count 512-fold.
inline void AdviseHugePages(const at::Tensor& out) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const size_t bytes = out.nbytes();
  if (!out.device().is_cpu() || bytes < 4 * kHugePage) return;
  const uintptr_t start = reinterpret_cast<uintptr_t>(out.data_ptr());
  const uintptr_t begin = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (start + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advisory only
#endif
}

// The Autograd kernel of an op without a gradient (upstream defines none), boxed so one function
// serves every such op: it runs the op below autograd, so its outputs never require grad, the
// kernel's and the reference's alike (a CompositeExplicitAutograd reference would otherwise
// record its ATen ops). Register with torch::CppFunction::makeFromBoxedFunction<&RunBelowAutograd>().
inline void RunBelowAutograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  at::AutoDispatchBelowADInplaceOrView guard;
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

}  // namespace tokamax
