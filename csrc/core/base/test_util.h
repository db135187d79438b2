// Helpers shared by the C++ tests: deterministic random data in any dtype, NaN poisoning,
// error measurement, a two-thread parallel backend, and a scoped ISA override.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "csrc/core/base/dtype.h"
#include "csrc/core/runtime/isa.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/scratch_arena.h"
#include "csrc/core/runtime/parallel.h"

namespace tokamax::testing {

// Storage of `count` elements of `dtype`, starting `misalign` elements past a 64-byte boundary
// (as torch's allocator aligns tensors) so tests can also see pointers that are not vector
// aligned. The malloc'd vector alone starts 16 bytes past a page for large sizes, which hid a
// prefetch gap from the benchmarks that only 64-byte aligned rows showed.
struct Buffer {
  Buffer(DType dtype, int64_t count, int64_t misalign = 0)
      : dtype(dtype), bytes(static_cast<size_t>((count + misalign) * DTypeSize(dtype)) + 64),
        misalign(misalign), count(count) {}
  void* data() { return Start() + misalign * DTypeSize(dtype); }
  const void* data() const { return const_cast<Buffer*>(this)->Start() + misalign * DTypeSize(dtype); }

  float Get(int64_t i) const {
    return DispatchDType(dtype, [&](auto tag) {
      using T = decltype(tag);
      return LoadAsFloat(static_cast<const T*>(data()) + i);
    });
  }
  void Set(int64_t i, float value) {
    DispatchDType(dtype, [&](auto tag) {
      using T = decltype(tag);
      StoreFromFloat(static_cast<T*>(data()) + i, value);
      return 0;
    });
  }

  DType dtype;
  std::vector<uint8_t> bytes;
  int64_t misalign;
  int64_t count;

 private:
  uint8_t* Start() {
    const uintptr_t address = reinterpret_cast<uintptr_t>(bytes.data());
    return bytes.data() + (64 - address % 64) % 64;
  }
};

inline void FillRandom(Buffer& buffer, int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < count; ++i) buffer.Set(i, dist(rng));
}

inline void Poison(Buffer& buffer, int64_t count) {
  for (int64_t i = 0; i < count; ++i) buffer.Set(i, std::numeric_limits<float>::quiet_NaN());
}

// max |got - want| / max(max |want|, 1e-6); NaN anywhere gives infinity.
inline double RelativeError(const Buffer& got, const Buffer& want, int64_t count) {
  double max_diff = 0.0, max_ref = 1e-6;
  for (int64_t i = 0; i < count; ++i) {
    const double g = got.Get(i), w = want.Get(i);
    if (std::isnan(g) || std::isnan(w)) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, std::fabs(g - w));
    max_ref = std::max(max_ref, std::fabs(w));
  }
  return max_diff / max_ref;
}

inline double Tolerance(DType dtype) {
  // Inputs are exactly representable in every dtype; only the output rounding differs.
  return dtype == DType::kFloat32 ? 2e-5 : (dtype == DType::kBFloat16 ? 1e-2 : 2e-3);
}

// Runs [begin, end) on two std::threads, so the tests exercise concurrent tasks.
inline void TwoThreadBackend(int64_t begin, int64_t end, int64_t grain, const ParallelBody& body) {
  const int64_t mid = begin + (end - begin + 1) / 2;
  std::thread worker([&] { if (mid < end) body(mid, end); });
  body(begin, mid);
  worker.join();
}

// Forces the tier `isa` through TOKAMAX_CPU_ISA for its lifetime.
class ScopedIsa {
 public:
  explicit ScopedIsa(Isa isa) { setenv("TOKAMAX_CPU_ISA", IsaName(isa), 1); }
  ~ScopedIsa() { unsetenv("TOKAMAX_CPU_ISA"); }
};

// Every cached byte of working memory (scratch arenas, the large-buffer cache) released and
// the shared limit set to 256 MiB for the scope; the caller's limit restored at its end.
class ScopedWorkingMemory {
 public:
  ScopedWorkingMemory() : saved_limit_(LargeBufferCacheLimit()) {
    SetLargeBufferCacheLimit(size_t{256} << 20);
    ReleaseCachedWorkingMemory();
  }
  ~ScopedWorkingMemory() {
    ReleaseCachedWorkingMemory();
    SetLargeBufferCacheLimit(saved_limit_);
  }
  ScopedWorkingMemory(const ScopedWorkingMemory&) = delete;
  ScopedWorkingMemory& operator=(const ScopedWorkingMemory&) = delete;

 private:
  size_t saved_limit_;
};

}  // namespace tokamax::testing
