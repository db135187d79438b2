// Small helpers every op adapter shares: dtype mapping, shape strings for error messages and
// huge-page advice for fresh outputs. Adapter-only (sees torch).
#pragma once

#include <ATen/ATen.h>

#include <sys/mman.h>

#include <sstream>
#include <string>

#include "csrc/core/base/dtype.h"

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

}  // namespace tokamax
