#include "csrc/core/large_buffer.h"

#include <cstdlib>
#include <new>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace tokamax {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

}  // namespace

LargeBufferBytes::LargeBufferBytes(size_t bytes, bool zeroed) {
#if defined(__linux__)
  if (bytes > kMapThreshold) {
    // Anonymous mappings are zero-filled by the kernel on first touch: no memset pass. Over-map
    // by one huge page so the buffer can start on a 2 MiB boundary, where whole huge pages fit.
    const size_t length = (bytes + kHugePage - 1) / kHugePage * kHugePage + kHugePage;
    void* mapping = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping != MAP_FAILED) {
      const uintptr_t start = (reinterpret_cast<uintptr_t>(mapping) + kHugePage - 1) / kHugePage * kHugePage;
      madvise(reinterpret_cast<void*>(start), length - (start - reinterpret_cast<uintptr_t>(mapping)),
              MADV_HUGEPAGE);  // advice only: where it is refused, 4 KiB pages serve as before
      mapping_ = mapping;
      mapped_bytes_ = length;
      data_ = reinterpret_cast<void*>(start);
      return;
    }
  }
#endif
  if (bytes == 0) bytes = 1;
  data_ = zeroed ? std::calloc(bytes, 1) : std::malloc(bytes);
  if (data_ == nullptr) throw std::bad_alloc();
}

LargeBufferBytes::~LargeBufferBytes() { Release(); }

LargeBufferBytes::LargeBufferBytes(LargeBufferBytes&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      mapped_bytes_(std::exchange(other.mapped_bytes_, 0)) {}

LargeBufferBytes& LargeBufferBytes::operator=(LargeBufferBytes&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
  }
  return *this;
}

void LargeBufferBytes::Release() {
#if defined(__linux__)
  if (mapping_ != nullptr) {
    munmap(mapping_, mapped_bytes_);
    mapping_ = nullptr;
    data_ = nullptr;
    return;
  }
#endif
  std::free(data_);
  data_ = nullptr;
}

}  // namespace tokamax
