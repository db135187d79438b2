// Writes that bypass the caches. An output from kStreamOutputBytes on is larger than the cache it
// would fill (a last-level cache's worth of a 2-core slice of a server part is ~16-32 MiB), so its
// lines are better not read before they are written (the read-for-ownership of a plain store)
// and not kept: non-temporal stores. StreamCopy is the plain-copy form (SSE2, in every x86-64
// build; memcpy elsewhere); the tiered kernels have vec.h's StreamNarrow. StreamFence() ends a
// task's non-temporal stores before another thread may read them.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace tokamax {

constexpr int64_t kStreamOutputBytes = int64_t{32} << 20;

// Whether StreamCopy may take dst and bytes: 16-byte aligned and a multiple of 16 bytes.
inline bool StreamCopyAligned(const void* dst, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(dst) % 16 == 0 && bytes % 16 == 0;
}

// bytes from src (any alignment) to dst (StreamCopyAligned) with non-temporal stores.
inline void StreamCopy(void* dst, const void* src, int64_t bytes) {
#if defined(__SSE2__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  for (int64_t b = 0; b < bytes; b += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + b), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b)));
  }
#else
  std::memcpy(dst, src, static_cast<size_t>(bytes));
#endif
}

inline void StreamCopyFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace tokamax
