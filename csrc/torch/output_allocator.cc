// Op outputs and gradients from the large-buffer cache (csrc/core/runtime/large_buffer.h): see
// NewOutput in adapter_utils.h and docs/design.md, "Pooled outputs".
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <cstring>

#include "csrc/core/runtime/large_buffer.h"
#include "csrc/torch/adapter_utils.h"

namespace tokamax {
namespace {

void DeleteLargeBuffer(void* context) { delete static_cast<LargeBufferBytes*>(context); }

// With the cache off (limit 0) outputs come from torch's allocator as before; the 2 MiB-aligned
// interior of a multi-MiB one is advised for transparent huge pages, which cuts its first-touch
// faults 512-fold (Linux, THP "madvise" mode; advice only).
void AdviseHugePages(void* data, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  if (bytes < 4 * kHugePage) return;
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (start + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

c10::DataPtr AllocateOutput(size_t bytes, bool zeroed) {
  if (bytes > LargeBufferBytes::kMapThreshold && LargeBufferCacheLimit() > 0) {
    // Uninitialised (zeroed on request); the deleter, on whatever thread frees the storage, hands
    // the mapping back to the cache.
    auto* buffer = new LargeBufferBytes(bytes, zeroed);
    void* data = buffer->data();
    return {data, buffer, &DeleteLargeBuffer, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DataPtr ptr = c10::GetDefaultCPUAllocator()->allocate(bytes);
  if (ptr.get() != nullptr) {
    if (zeroed) {
      std::memset(ptr.get(), 0, bytes);
    } else {
      AdviseHugePages(ptr.get(), bytes);
#if defined(__SANITIZE_ADDRESS__)
      std::memset(ptr.get(), 0xff, bytes);  // as LargeBufferBytes: unwritten elements read as NaN
#endif
    }
  }
  return ptr;
}

// The storages' allocator: resize_ of an output grows it through here too.
class OutputAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override { return AllocateOutput(bytes, false); }
  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }
};

OutputAllocator& TheAllocator() {
  static OutputAllocator* allocator = new OutputAllocator();  // never destroyed: storages may outlive statics
  return *allocator;
}

at::Tensor MakeOutput(c10::SymIntArrayRef sizes, std::optional<c10::SymIntArrayRef> strides,
                      const at::TensorOptions& options, bool zeroed) {
  const auto concrete = c10::asIntArrayRefSlowOpt(sizes);
  if (options.device().type() != c10::DeviceType::CPU || !concrete.has_value() ||
      options.layout() != c10::kStrided) {
    if (strides.has_value()) return at::empty_strided_symint(sizes, *strides, options);
    return zeroed ? at::zeros_symint(sizes, options) : at::empty_symint(sizes, options);
  }
  const caffe2::TypeMeta dtype = options.dtype();
  size_t bytes = 0;
  std::optional<at::IntArrayRef> concrete_strides;
  if (strides.has_value()) {
    concrete_strides = c10::asIntArrayRefSlowOpt(*strides);
    TORCH_CHECK(concrete_strides.has_value(), "NewOutput: concrete sizes with symbolic strides");
    bytes = at::detail::computeStorageNbytes(*concrete, *concrete_strides, dtype.itemsize());
  } else {
    bytes = at::detail::computeStorageNbytesContiguous(*concrete, dtype.itemsize());
  }
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), bytes,
                                                       AllocateOutput(bytes, zeroed), &TheAllocator(),
                                                       /*resizable=*/true);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                            dtype);
  if (concrete_strides.has_value()) {
    out.unsafeGetTensorImpl()->set_sizes_and_strides(*concrete, *concrete_strides);
  } else {
    out.unsafeGetTensorImpl()->set_sizes_contiguous(*concrete);
  }
  return out;
}

}  // namespace

at::Tensor NewOutputSymint(c10::SymIntArrayRef sizes, const at::TensorOptions& options) {
  return MakeOutput(sizes, std::nullopt, options, false);
}

at::Tensor NewZeroedOutputSymint(c10::SymIntArrayRef sizes, const at::TensorOptions& options) {
  return MakeOutput(sizes, std::nullopt, options, true);
}

at::Tensor NewOutputLike(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  // empty_like's layout for a dense tensor (a transposed weight view gets a transposed gradient),
  // else contiguous.
  const at::TensorOptions options = dtype.has_value() ? t.options().dtype(*dtype) : t.options();
  if (t.is_non_overlapping_and_dense()) return MakeOutput(t.sym_sizes(), t.sym_strides(), options, false);
  return MakeOutput(t.sym_sizes(), std::nullopt, options, false);
}

}  // namespace tokamax

// For tests (tests/test_pooled_outputs.py): an output as the adapters make it, uninitialised.
TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("_new_output(int[] size, ScalarType dtype) -> Tensor", [](std::vector<int64_t> size, at::ScalarType dtype) {
    return tokamax::NewOutput(size, at::TensorOptions().dtype(dtype));
  });
}
