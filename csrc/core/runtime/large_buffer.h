// Per-call working memory of O(S) size (packed K/V copies, partial sums), allocated and freed
// once per call. Above kMapThreshold it is mapped here, 2 MiB-aligned and advised for
// transparent huge pages, and a released mapping is kept in a process-wide cache for the next
// call of about the same size instead of being unmapped: glibc returns such blocks to the
// kernel, so each call would fault its buffers in again, zeroed page by page. Measured on Zen 4
// (2 vCPUs, KVM), causal fp32 attention forward+backward at T=S=2048, N=K=16: page faults were
// ~10% of the samples. The torch adapters' large outputs are LargeBufferBytes too (pooled
// outputs, docs/design.md), so a freed output's mapping serves the next call's. The cache holds at
// most LargeBufferCacheLimit() bytes (environment variable TOKAMAX_BUFFER_CACHE_MIB; default 1/8
// of physical or cgroup memory, clamped to [256 MiB, 4 GiB]; 0 turns it off) less what the scratch
// arenas hold (scratch_arena.h): the one limit bounds all cached memory.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tokamax {

class LargeBufferBytes {
 public:
  LargeBufferBytes() = default;
  // Smaller buffers come from malloc, which reuses a freed block of that size.
  static constexpr size_t kMapThreshold = size_t{1} << 20;
  // `bytes` bytes, zero when `zeroed` (else unspecified: a reused mapping holds what its last
  // owner wrote), aligned as malloc aligns (2 MiB aligned when mapped).
  LargeBufferBytes(size_t bytes, bool zeroed);
  ~LargeBufferBytes();
  LargeBufferBytes(LargeBufferBytes&& other) noexcept;
  LargeBufferBytes& operator=(LargeBufferBytes&& other) noexcept;
  LargeBufferBytes(const LargeBufferBytes&) = delete;
  LargeBufferBytes& operator=(const LargeBufferBytes&) = delete;

  void* data() const { return data_; }

 private:
  void Release();
  void FillUninitialized(bool zeroed, size_t bytes);
  void* data_ = nullptr;
  void* mapping_ = nullptr;  // what munmap gets back; null when data_ came from malloc/calloc
  size_t mapped_bytes_ = 0;
};

// The cache of released mappings (thread-safe). Setting the limit evicts what no longer fits;
// ReleaseLargeBufferCache unmaps everything cached and keeps the limit; TrimLargeBufferCache
// evicts what no longer fits beside the scratch arenas (called when they grew).
size_t LargeBufferCacheLimit();
void SetLargeBufferCacheLimit(size_t bytes);
// What LargeBufferCacheLimit() is when TOKAMAX_BUFFER_CACHE_MIB is unset.
size_t DefaultLargeBufferCacheLimit();
size_t LargeBufferCachedBytes();
void ReleaseLargeBufferCache();
void TrimLargeBufferCache();

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
