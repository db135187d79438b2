// LargeBuffer: zero-filled when asked and writable end to end, from malloc and mapped, and
// movable without a double free; the cache of released mappings reuses, zeroes on request and
// stays within its limit.
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/scratch_arena.h"

#include "csrc/core/base/test_util.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <utility>

namespace tokamax {
namespace {

TEST(LargeBufferTest, ZeroFilledAndWritableAtEverySize) {
  // 1 float, a few KiB, at the map threshold (malloc), just past it and an odd size (mapped).
  constexpr int64_t kThresholdFloats = LargeBufferBytes::kMapThreshold / sizeof(float);
  for (int64_t count : {int64_t{1}, int64_t{1000}, kThresholdFloats, kThresholdFloats + 1, kThresholdFloats + 777}) {
    LargeBuffer<float> buffer(count, LargeBuffer<float>::kZeroed);
    ASSERT_NE(buffer.data(), nullptr) << count;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % 16, 0u) << count;
    int64_t nonzero = 0;
    for (int64_t i = 0; i < count; ++i) nonzero += buffer[i] != 0.0f;
    EXPECT_EQ(nonzero, 0) << count;
    for (int64_t i = 0; i < count; ++i) buffer[i] = static_cast<float>(i);
    EXPECT_EQ(buffer[count - 1], static_cast<float>(count - 1)) << count;
    LargeBuffer<float> scratch(count, LargeBuffer<float>::kUninitialized);
    ASSERT_NE(scratch.data(), nullptr) << count;
    scratch[0] = scratch[count - 1] = 1.0f;  // writable at both ends
    EXPECT_EQ(scratch[0] + scratch[count - 1], 2.0f) << count;
  }
}

TEST(LargeBufferTest, DefaultLimitIsBounded) {
  // 1/8 of usable memory, clamped: never below the old fixed 256 MiB nor above 4 GiB.
  EXPECT_GE(DefaultLargeBufferCacheLimit(), size_t{256} << 20);
  EXPECT_LE(DefaultLargeBufferCacheLimit(), size_t{4} << 30);
}

TEST(LargeBufferTest, MoveTransfersOwnership) {
  LargeBuffer<uint16_t> a(int64_t{20} << 20, LargeBuffer<uint16_t>::kZeroed);  // 40 MiB: mapped
  a[5] = 7;
  LargeBuffer<uint16_t> b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b[5], 7);
  LargeBuffer<uint16_t> c(16, LargeBuffer<uint16_t>::kZeroed);
  c = std::move(b);  // frees c's own buffer, takes b's
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(c[5], 7);
  EXPECT_EQ(LargeBuffer<float>().data(), nullptr);
}

// Restores the cache's limit and empties it (and the scratch arenas of earlier tests, which
// would shrink the cache's share) around a test.
class LargeBufferCacheTest : public ::testing::Test {
 protected:
  testing::ScopedWorkingMemory working_memory_;
};

constexpr int64_t kMappedFloats = int64_t{5} << 20;  // 20 MiB: past the map threshold

TEST_F(LargeBufferCacheTest, ReleasedMappingIsReusedAndZeroedOnRequest) {
  const float* first = nullptr;
  {
    LargeBuffer<float> buffer(kMappedFloats, LargeBuffer<float>::kUninitialized);
    first = buffer.data();
    for (int64_t i = 0; i < kMappedFloats; i += 1024) buffer[i] = 3.0f;
    EXPECT_EQ(LargeBufferCachedBytes(), 0u);
  }
  const size_t cached = LargeBufferCachedBytes();
  EXPECT_GE(cached, static_cast<size_t>(kMappedFloats) * sizeof(float));
  {
    LargeBuffer<float> zeroed(kMappedFloats, LargeBuffer<float>::kZeroed);
    EXPECT_EQ(zeroed.data(), first);  // the same pages, already faulted in
    EXPECT_EQ(LargeBufferCachedBytes(), 0u);
    int64_t nonzero = 0;
    for (int64_t i = 0; i < kMappedFloats; ++i) nonzero += zeroed[i] != 0.0f;
    EXPECT_EQ(nonzero, 0);
  }
  EXPECT_EQ(LargeBufferCachedBytes(), cached);
  ReleaseLargeBufferCache();
  EXPECT_EQ(LargeBufferCachedBytes(), 0u);
}

TEST_F(LargeBufferCacheTest, SmallRequestsDoNotPinLargeMappings) {
  { LargeBuffer<float> large(kMappedFloats * 4, LargeBuffer<float>::kUninitialized); }
  const size_t cached = LargeBufferCachedBytes();
  ASSERT_GT(cached, 0u);
  {
    LargeBuffer<float> small(kMappedFloats / 4, LargeBuffer<float>::kZeroed);  // 5 MiB
    EXPECT_EQ(LargeBufferCachedBytes(), cached);  // the 80 MiB mapping stayed cached
    EXPECT_EQ(small[kMappedFloats / 4 - 1], 0.0f);
  }
  EXPECT_GT(LargeBufferCachedBytes(), cached);  // and now the small one is cached too
}

TEST_F(LargeBufferCacheTest, LimitBoundsTheCache) {
  SetLargeBufferCacheLimit(size_t{30} << 20);
  { LargeBuffer<float> a(kMappedFloats, LargeBuffer<float>::kUninitialized); }
  const size_t one = LargeBufferCachedBytes();
  ASSERT_GT(one, 0u);
  ASSERT_LE(one, size_t{30} << 20);
  {
    // Two at once: releasing both keeps only what fits the limit, the newest.
    LargeBuffer<float> b(kMappedFloats, LargeBuffer<float>::kUninitialized);
    LargeBuffer<float> c(kMappedFloats, LargeBuffer<float>::kUninitialized);
    EXPECT_EQ(LargeBufferCachedBytes(), 0u);
  }
  EXPECT_EQ(LargeBufferCachedBytes(), one);
  // Too large for the limit: unmapped on release.
  { LargeBuffer<float> d(kMappedFloats * 2, LargeBuffer<float>::kUninitialized); }
  EXPECT_EQ(LargeBufferCachedBytes(), one);
  SetLargeBufferCacheLimit(0);  // evicts everything, and nothing is kept from now on
  EXPECT_EQ(LargeBufferCachedBytes(), 0u);
  { LargeBuffer<float> e(kMappedFloats, LargeBuffer<float>::kUninitialized); }
  EXPECT_EQ(LargeBufferCachedBytes(), 0u);
}

}  // namespace
}  // namespace tokamax
