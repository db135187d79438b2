// Per-call working memory of O(S) size (packed K/V copies, partial sums): zero-filled, and
// where Linux offers transparent huge pages on request (`madvise` mode, the common default),
// backed by 2 MiB pages. Such buffers are written once per call and freed after it, so in 4 KiB
// pages their first touch costs one page fault per 4 KiB (measured: a 32 MiB first touch on 2
// threads took 12-17 ms with 4 KiB pages, 7 ms with 2 MiB pages, 3.5 ms rewritten).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tokamax {

class LargeBufferBytes {
 public:
  LargeBufferBytes() = default;
  // `bytes` zero bytes, aligned as malloc aligns (2 MiB aligned when mapped for huge pages).
  explicit LargeBufferBytes(size_t bytes);
  ~LargeBufferBytes();
  LargeBufferBytes(LargeBufferBytes&& other) noexcept;
  LargeBufferBytes& operator=(LargeBufferBytes&& other) noexcept;
  LargeBufferBytes(const LargeBufferBytes&) = delete;
  LargeBufferBytes& operator=(const LargeBufferBytes&) = delete;

  void* data() const { return data_; }

 private:
  void Release();
  void* data_ = nullptr;
  void* mapping_ = nullptr;  // what munmap gets back; null when data_ came from calloc
  size_t mapped_bytes_ = 0;
};

// `count` zero-initialised T (trivial types: float, uint16_t).
template <typename T>
class LargeBuffer {
 public:
  LargeBuffer() = default;
  explicit LargeBuffer(int64_t count) : bytes_(static_cast<size_t>(count > 0 ? count : 1) * sizeof(T)) {}
  T* data() const { return static_cast<T*>(bytes_.data()); }
  T& operator[](int64_t i) const { return data()[i]; }

 private:
  LargeBufferBytes bytes_;
};

}  // namespace tokamax
