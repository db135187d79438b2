// ScratchLease: buffers kept between leases, nested leases on one thread never alias, the limit
// is respected, ReleaseScratch frees idle arenas at once and leased ones when their lease ends,
// and threads unregister their arenas on exit, with releases from other threads concurrent.
#include "csrc/core/runtime/scratch_arena.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "csrc/core/base/test_util.h"
#include "csrc/core/runtime/large_buffer.h"

namespace tokamax {
namespace {

// Empties everything cached and restores the limit around a test.
class ScratchArenaTest : public ::testing::Test {
 protected:
  testing::ScopedWorkingMemory working_memory_;
};

TEST_F(ScratchArenaTest, KeptBetweenLeasesGrownLikeAVector) {
  float* first = nullptr;
  {
    ScratchLease lease;
    first = lease.Get<float>(3, 1000);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    for (int i = 0; i < 1000; ++i) EXPECT_EQ(first[i], 0.0f) << i;  // fresh memory is zero
    for (int i = 0; i < 1000; ++i) first[i] = static_cast<float>(i);
    EXPECT_EQ(lease.Get<float>(3, 10), first);  // a smaller request: the same buffer
  }
  EXPECT_GE(ScratchIdleBytes(), 1000 * sizeof(float));
  ScratchLease lease;
  EXPECT_EQ(lease.Get<float>(3, 1000), first);  // reused across leases
  EXPECT_EQ(ScratchIdleBytes(), 0u);             // leased: in use, not cached
  float* grown = lease.Get<float>(3, 100000);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(grown[i], static_cast<float>(i)) << i;  // kept
  for (int i = 1000; i < 100000; ++i) ASSERT_EQ(grown[i], 0.0f) << i;               // new: zero
}

TEST_F(ScratchArenaTest, NestedLeasesDoNotAlias) {
  ScratchLease outer;
  char* a = outer.Get<char>(0, 4096);
  std::memset(a, 1, 4096);
  {
    ScratchLease inner;
    char* b = inner.Get<char>(0, 4096);
    EXPECT_TRUE(b + 4096 <= a || a + 4096 <= b);
    std::memset(b, 2, 4096);
    {
      ScratchLease innermost;
      char* c = innermost.Get<char>(0, 4096);
      EXPECT_TRUE((c + 4096 <= a || a + 4096 <= c) && (c + 4096 <= b || b + 4096 <= c));
      std::memset(c, 3, 4096);
    }
    for (int i = 0; i < 4096; ++i) ASSERT_EQ(b[i], 2) << i;
  }
  for (int i = 0; i < 4096; ++i) ASSERT_EQ(a[i], 1) << i;
  // Same-level leases after the nested ones ended: the same arena again, and not the outer's.
  ScratchLease again;
  EXPECT_NE(again.Get<char>(0, 4096), a);
}

TEST_F(ScratchArenaTest, ReleaseFreesIdleArenasAndLeasedOnesWhenTheirLeaseEnds) {
  { ScratchLease lease; lease.Get<float>(0, 1 << 16); }
  EXPECT_GT(ScratchIdleBytes(), 0u);
  EXPECT_GT(ScratchHeldBytes(), 0u);
  ReleaseScratch();
  EXPECT_EQ(ScratchIdleBytes(), 0u);
  EXPECT_EQ(ScratchHeldBytes(), 0u);

  {
    ScratchLease lease;
    float* x = lease.Get<float>(0, 1 << 16);
    ReleaseScratch();  // in use: not freed now
    x[(1 << 16) - 1] = 1.0f;
    EXPECT_GT(ScratchHeldBytes(), 0u);
  }
  EXPECT_EQ(ScratchHeldBytes(), 0u);  // freed as the lease ended
  EXPECT_EQ(CachedWorkingMemoryBytes(), 0u);
}

TEST_F(ScratchArenaTest, LimitIsRespected) {
  SetLargeBufferCacheLimit(size_t{1} << 20);
  { ScratchLease lease; lease.Get<char>(0, 512 << 10); }
  EXPECT_GE(ScratchIdleBytes(), size_t{512} << 10);  // fits: kept
  { ScratchLease lease; lease.Get<char>(1, 2 << 20); }
  EXPECT_EQ(ScratchIdleBytes(), 0u);  // over the limit: the arena freed itself
  SetLargeBufferCacheLimit(0);
  { ScratchLease lease; lease.Get<char>(0, 64); }
  EXPECT_EQ(ScratchHeldBytes(), 0u);  // limit 0: nothing cached
}

TEST_F(ScratchArenaTest, LargeBufferCacheGetsWhatTheArenasLeave) {
  SetLargeBufferCacheLimit(size_t{16} << 20);
  { LargeBuffer<char> big(int64_t{6} << 20, LargeBuffer<char>::kUninitialized); }  // 8 MiB mapping cached
  const size_t mapped = LargeBufferCachedBytes();
  ASSERT_GT(mapped, size_t{6} << 20);
  { ScratchLease lease; lease.Get<char>(0, 12 << 20); }  // 12 MiB of scratch: the mapping no longer fits
  EXPECT_EQ(LargeBufferCachedBytes(), 0u);
  EXPECT_LE(CachedWorkingMemoryBytes(), size_t{16} << 20);
}

TEST_F(ScratchArenaTest, ThreadsUnregisterAndReleaseFromAnotherThreadIsSafe) {
  const size_t arenas_before = ScratchArenaCount();
  std::atomic<bool> stop{false};
  std::thread releaser([&] {
    while (!stop.load()) {
      ReleaseCachedWorkingMemory();
      (void)CachedWorkingMemoryBytes();
    }
  });
  std::vector<std::thread> workers;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        ScratchLease outer;
        const int64_t n = 256 + (i * 37 + t) % 4096;
        int32_t* x = outer.Get<int32_t>(i % 4, n);
        for (int64_t j = 0; j < n; ++j) x[j] = t * 1000 + i;
        {
          ScratchLease inner;
          int32_t* y = inner.Get<int32_t>(i % 4, n);
          for (int64_t j = 0; j < n; ++j) y[j] = -1;
        }
        for (int64_t j = 0; j < n; ++j) bad += x[j] != t * 1000 + i;
      }
    });
  }
  for (std::thread& w : workers) w.join();
  stop = true;
  releaser.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(ScratchArenaCount(), arenas_before);  // each worker's two arenas went with it
  ReleaseCachedWorkingMemory();
  EXPECT_EQ(CachedWorkingMemoryBytes(), 0u);
}

}  // namespace
}  // namespace tokamax
