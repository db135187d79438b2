#include "csrc/core/runtime/large_buffer.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "csrc/core/runtime/scratch_arena.h"

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

namespace tokamax {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kMinDefaultLimit = size_t{256} << 20;
constexpr size_t kMaxDefaultLimit = size_t{4} << 30;

// Bytes of memory the process may use: physical memory, or a cgroup's limit when lower (a
// container on a large host). 0 when unknown.
size_t UsableMemoryBytes() {
#if defined(__linux__)
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  size_t usable = pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    if (FILE* f = std::fopen(path, "r")) {
      unsigned long long limit = 0;
      if (std::fscanf(f, "%llu", &limit) == 1 && limit > 0 && (usable == 0 || limit < usable)) {
        usable = static_cast<size_t>(limit);  // "max" (no limit) does not parse
      }
      std::fclose(f);
    }
  }
  return usable;
#else
  return 0;
#endif
}

// The default: 1/8 of usable memory, at least 256 MiB and at most 4 GiB (docs/design.md,
// "Pooled outputs": a training step's outputs and gradients come back to the cache, and the
// largest measured, fused_moe's fp32 weight gradients at E=64, are 2.2 GB).
size_t DefaultLimit() {
  return std::clamp(UsableMemoryBytes() / 8, kMinDefaultLimit, kMaxDefaultLimit);
}

size_t LimitFromEnvironment() {
  const char* value = std::getenv("TOKAMAX_BUFFER_CACHE_MIB");
  if (value == nullptr || *value == '\0') return DefaultLimit();
  char* end = nullptr;
  errno = 0;
  const long long mib = std::strtoll(value, &end, 10);
  // Anything but a non-negative integer keeps the default (a warning would need a logger the
  // core does not have; docs/design.md states the format). Values whose bytes pass 2^62 (far
  // past any memory) are held at that: shifted, they would wrap to 0 or a negative limit.
  if (*end != '\0' || mib < 0 || errno == ERANGE) return DefaultLimit();
  constexpr long long kMaxMib = (1LL << 62) >> 20;
  return static_cast<size_t>(std::min(mib, kMaxMib)) << 20;
}

struct Mapping {
  void* base = nullptr;
  size_t bytes = 0;
};

// AddressSanitizer does not watch mmap'd memory. Under it (`make sanitize`) a mapping is
// poisoned but for the `used_bytes` at `used` its owner holds, so a kernel touching bytes past
// its buffer, or a buffer it released to the cache, is reported. No-op in other builds.
void MarkInUse(const Mapping& m, const void* used, size_t used_bytes) {
#if defined(__SANITIZE_ADDRESS__)
  ASAN_POISON_MEMORY_REGION(m.base, m.bytes);
  if (used != nullptr) ASAN_UNPOISON_MEMORY_REGION(used, used_bytes);
#endif
}

// Released mappings, most recently released last. A request takes the smallest one that holds
// it and is at most twice its size (a small buffer does not pin a large mapping).
class MappingCache {
 public:
  static MappingCache& Get() {
    static MappingCache* cache = new MappingCache();  // never destroyed: buffers may outlive statics
    return *cache;
  }

  Mapping Take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      const size_t size = free_[i].bytes;
      if (size >= bytes && size / 2 <= bytes && (best == free_.size() || size < free_[best].bytes)) best = i;
    }
    if (best == free_.size()) return {};
    const Mapping taken = free_[best];
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
    cached_ -= taken.bytes;
    return taken;
  }

  // Keeps `m` when it fits its share of the limit, evicting the oldest mappings for it; else
  // unmaps it.
  void Give(Mapping m) {
    std::vector<Mapping> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const size_t share = Share();
      if (m.bytes > share) {
        evicted.push_back(m);
      } else {
        free_.push_back(m);
        cached_ += m.bytes;
        EvictOver(share, &evicted);
      }
    }
    Unmap(evicted);
  }

  // Read by every scratch lease's end: an atomic, no lock.
  size_t limit() const { return limit_.load(std::memory_order_relaxed); }

  size_t cached() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_;
  }

  // Sets the limit and evicts what no longer fits.
  void SetLimit(size_t bytes) { Evict(&bytes, SIZE_MAX); }

  // Evicts what no longer fits the share the scratch arenas leave.
  void Trim() { Evict(nullptr, SIZE_MAX); }

  // Unmaps everything cached; the limit stays.
  void Clear() { Evict(nullptr, 0); }

 private:
  MappingCache() : limit_(LimitFromEnvironment()) {}

  // The limit less what the scratch arenas hold (scratch_arena.h): one limit covers both, the
  // arenas first.
  size_t Share() const {
    const size_t limit = limit_.load(std::memory_order_relaxed);
    const size_t scratch = ScratchHeldBytes();
    return scratch < limit ? limit - scratch : 0;
  }

  // Sets the limit when `new_limit` is given, then evicts down to `keep` bytes or the share,
  // whichever is less.
  void Evict(const size_t* new_limit, size_t keep) {
    std::vector<Mapping> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (new_limit != nullptr) limit_.store(*new_limit, std::memory_order_relaxed);
      EvictOver(std::min(keep, Share()), &evicted);
    }
    Unmap(evicted);
  }

  void EvictOver(size_t keep, std::vector<Mapping>* evicted) {
    size_t drop = 0;
    while (cached_ > keep && drop < free_.size()) {
      cached_ -= free_[drop].bytes;
      evicted->push_back(free_[drop++]);
    }
    free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(drop));
  }

  // Outside the lock: munmap can take a while (TLB shootdowns).
  static void Unmap(const std::vector<Mapping>& mappings) {
#if defined(__linux__)
    for (const Mapping& m : mappings) {
      MarkInUse(m, m.base, m.bytes);  // the address range may be mapped again by anyone
      munmap(m.base, m.bytes);
    }
#endif
  }

  std::mutex mutex_;
  std::vector<Mapping> free_;
  size_t cached_ = 0;
  std::atomic<size_t> limit_;  // written under mutex_
};

}  // namespace

LargeBufferBytes::LargeBufferBytes(size_t bytes, bool zeroed) {
#if defined(__linux__)
  if (bytes > kMapThreshold) {
    // Over-map by one huge page so the buffer can start on a 2 MiB boundary, where whole huge
    // pages fit.
    const size_t length = (bytes + kHugePage - 1) / kHugePage * kHugePage + kHugePage;
    Mapping m = MappingCache::Get().Take(length);
    const bool reused = m.base != nullptr;
    if (!reused) {
      // Anonymous mappings are zero-filled by the kernel on first touch: no memset pass.
      void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base != MAP_FAILED) m = {base, length};
    }
    if (m.base != nullptr) {
      const uintptr_t start = (reinterpret_cast<uintptr_t>(m.base) + kHugePage - 1) / kHugePage * kHugePage;
      if (!reused) {
        madvise(reinterpret_cast<void*>(start), m.bytes - (start - reinterpret_cast<uintptr_t>(m.base)),
                MADV_HUGEPAGE);  // advice only: where it is refused, 4 KiB pages serve as before
      }
      mapping_ = m.base;
      mapped_bytes_ = m.bytes;
      data_ = reinterpret_cast<void*>(start);
      MarkInUse(m, data_, bytes);
      if (reused && zeroed) std::memset(data_, 0, bytes);
      FillUninitialized(zeroed, bytes);
      return;
    }
  }
#endif
  if (bytes == 0) bytes = 1;
  data_ = zeroed ? std::calloc(bytes, 1) : std::malloc(bytes);
  if (data_ == nullptr) throw std::bad_alloc();
  FillUninitialized(zeroed, bytes);
}

void LargeBufferBytes::FillUninitialized(bool zeroed, size_t bytes) {
#if defined(__SANITIZE_ADDRESS__)
  // Sanitizer builds: an uninitialised buffer is all ones (NaN as fp32, bf16 and fp16), not the
  // zeros of a fresh mapping, so a kernel reading what it never wrote fails its tests.
  if (!zeroed) std::memset(data_, 0xff, bytes);
#endif
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
  if (mapping_ != nullptr) {
    MarkInUse({mapping_, mapped_bytes_}, nullptr, 0);
    MappingCache::Get().Give({mapping_, mapped_bytes_});
    mapping_ = nullptr;
    data_ = nullptr;
    return;
  }
  std::free(data_);
  data_ = nullptr;
}

size_t LargeBufferCacheLimit() { return MappingCache::Get().limit(); }

size_t DefaultLargeBufferCacheLimit() { return DefaultLimit(); }

void SetLargeBufferCacheLimit(size_t bytes) { MappingCache::Get().SetLimit(bytes); }

size_t LargeBufferCachedBytes() { return MappingCache::Get().cached(); }

void ReleaseLargeBufferCache() { MappingCache::Get().Clear(); }

void TrimLargeBufferCache() { MappingCache::Get().Trim(); }

}  // namespace tokamax
