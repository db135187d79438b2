// Per-call working memory of O(S) size (packed K/V copies, partial sums), allocated and freed
// once per call. Below kMapThreshold it comes from malloc, which reuses a freed block of that
// size without new page faults. glibc maps anything larger afresh on every call, so each call
// would fault it in 4 KiB at a time; such buffers are mapped here instead, 2 MiB-aligned and
// advised for transparent huge pages (Linux, THP `madvise` mode, the common default). Measured
// on the development VM, a 34 MiB zeroed buffer allocated and written by 2 threads: 23-27 ms
// as a std::vector, 35-46 ms as new[] without zeroing, 5-6.5 ms mapped here.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tokamax {

class LargeBufferBytes {
 public:
  LargeBufferBytes() = default;
  // glibc's largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit).
  static constexpr size_t kMapThreshold = size_t{32} << 20;
  // `bytes` bytes, zero when `zeroed` (else unspecified), aligned as malloc aligns (2 MiB
  // aligned when mapped; mapped memory is always zero).
  LargeBufferBytes(size_t bytes, bool zeroed);
  ~LargeBufferBytes();
  LargeBufferBytes(LargeBufferBytes&& other) noexcept;
  LargeBufferBytes& operator=(LargeBufferBytes&& other) noexcept;
  LargeBufferBytes(const LargeBufferBytes&) = delete;
  LargeBufferBytes& operator=(const LargeBufferBytes&) = delete;

  void* data() const { return data_; }

 private:
  void Release();
  void* data_ = nullptr;
  void* mapping_ = nullptr;  // what munmap gets back; null when data_ came from malloc/calloc
  size_t mapped_bytes_ = 0;
};

// `count` T (trivial types: float, uint16_t), zero-initialised when `zeroed`; the caller
// writes every element it reads otherwise.
template <typename T>
class LargeBuffer {
 public:
  enum Init { kZeroed, kUninitialized };
  LargeBuffer() = default;
  LargeBuffer(int64_t count, Init init)
      : bytes_(static_cast<size_t>(count > 0 ? count : 1) * sizeof(T), init == kZeroed) {}
  T* data() const { return static_cast<T*>(bytes_.data()); }
  T& operator[](int64_t i) const { return data()[i]; }

 private:
  LargeBufferBytes bytes_;
};

}  // namespace tokamax
