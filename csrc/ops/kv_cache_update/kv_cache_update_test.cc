// kv_cache_update against a per-element scalar reference: exact (a copy), every dtype, strided
// keys, int32 and int64 slots, padding, two threads; slot errors leave the cache untouched.
#include "csrc/ops/kv_cache_update/kv_cache_update.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "csrc/core/base/int_math.h"
#include "csrc/core/base/streaming.h"
#include "csrc/core/base/test_util.h"
#include "csrc/core/runtime/parallel.h"

namespace tokamax {
namespace {

constexpr int64_t kPages = 7, kPageSize = 3, kHeads = 2, kD = 5, kTokens = 6;

struct Problem {
  std::vector<double> cache, keys, values;  // doubles hold every dtype's values exactly
  std::vector<int64_t> slots = {4, -1, 20, 0, 13, 7};
};

Problem MakeProblem() {
  Problem p;
  p.cache.resize(kPages * kPageSize * 2 * kHeads * kD);
  p.keys.resize(kTokens * kHeads * kD);
  p.values.resize(p.keys.size());
  for (size_t i = 0; i < p.cache.size(); ++i) p.cache[i] = static_cast<double>(i % 97) - 40;
  for (size_t i = 0; i < p.keys.size(); ++i) p.keys[i] = 100 + static_cast<double>(i), p.values[i] = -100 - double(i);
  return p;
}

// The expected cache: token t's K of head h at merged head 2h of its slot, its V at 2h+1.
std::vector<double> Expected(const Problem& p) {
  std::vector<double> out = p.cache;
  for (int64_t t = 0; t < kTokens; ++t) {
    if (p.slots[t] < 0) continue;
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t j = 0; j < kD; ++j) {
        const int64_t row = p.slots[t] * 2 * kHeads;
        out[(row + 2 * h) * kD + j] = p.keys[(t * kHeads + h) * kD + j];
        out[(row + 2 * h + 1) * kD + j] = p.values[(t * kHeads + h) * kD + j];
      }
    }
  }
  return out;
}

// Runs the kernel with keys stored transposed ([T, D, H] memory, [T, H, D] view) and returns
// the cache as doubles, or the error.
Status RunKernel(DType dtype, bool int64_slots, const Problem& p, std::vector<double>* cache_out) {
  testing::Buffer cache(dtype, static_cast<int64_t>(p.cache.size()), 1), keys(dtype, kTokens * kHeads * kD, 3),
      values(dtype, kTokens * kHeads * kD);
  for (size_t i = 0; i < p.cache.size(); ++i) cache.Set(i, float(p.cache[i]));
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t j = 0; j < kD; ++j) {
        keys.Set((t * kD + j) * kHeads + h, float(p.keys[(t * kHeads + h) * kD + j]));
        values.Set((t * kHeads + h) * kD + j, float(p.values[(t * kHeads + h) * kD + j]));
      }
    }
  }
  std::vector<int32_t> slots32(p.slots.begin(), p.slots.end());
  KvCacheUpdateParams params;
  params.cache = {cache.data(), dtype, {kPages, kPageSize, 2 * kHeads, kD},
                  {kPageSize * 2 * kHeads * kD, 2 * kHeads * kD, kD, 1}};
  params.keys = {keys.data(), dtype, {kTokens, kHeads, kD}, {kD * kHeads, 1, kHeads}};
  params.values = {values.data(), dtype, {kTokens, kHeads, kD}, {kHeads * kD, kD, 1}};
  params.slots.data = int64_slots ? static_cast<const void*>(p.slots.data()) : slots32.data();
  params.slots.is_int64 = int64_slots;
  params.slots.count = kTokens;
  const Status status = KvCacheUpdate(params);
  cache_out->resize(p.cache.size());
  for (size_t i = 0; i < p.cache.size(); ++i) (*cache_out)[i] = cache.Get(i);
  return status;
}

TEST(KvCacheUpdateTest, WritesExactlyTheSlotsOfEveryDtype) {
  SetParallelBackend(&testing::TwoThreadBackend);
  const Problem p = MakeProblem();
  const std::vector<double> want = Expected(p);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
    for (bool int64_slots : {false, true}) {
      std::vector<double> got;
      ASSERT_TRUE(RunKernel(dtype, int64_slots, p, &got).ok());
      EXPECT_EQ(got, want) << DTypeName(dtype) << " int64=" << int64_slots;
    }
  }
  SetParallelBackend(nullptr);
}

// An update from kStreamOutputBytes on takes the non-temporal copy: the same bits in the written
// slots, every other slot (and the skipped tokens') untouched, on two threads.
TEST(KvCacheUpdateTest, UpdatesLargerThanTheCachesAreExact) {
  constexpr int64_t kBigHeads = 8, kBigD = 128, kBigPageSize = 16;
  constexpr int64_t kRow = 2 * kBigHeads * kBigD;  // bf16 elements per slot
  const int64_t tokens = kStreamOutputBytes / (kRow * 2) + 37;
  const int64_t pages = CeilDiv(tokens + 100, kBigPageSize), num_slots = pages * kBigPageSize;
  std::vector<uint16_t> cache(static_cast<size_t>(num_slots * kRow));
  std::vector<uint16_t> keys(static_cast<size_t>(tokens * kBigHeads * kBigD)), values(keys.size());
  for (size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<uint16_t>(i * 7 + 1);
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i] = static_cast<uint16_t>(i * 13 + 2);
    values[i] = static_cast<uint16_t>(i * 17 + 3);
  }
  // Slots in a scattered order (a stride coprime to num_slots), every 50th token padding.
  std::vector<int64_t> slots(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) slots[t] = t % 50 == 7 ? -1 : (t * 7919) % num_slots;
  std::vector<uint16_t> want = cache;
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < kBigHeads; ++h) {
      std::memcpy(&want[(slots[t] * 2 * kBigHeads + 2 * h) * kBigD], &keys[(t * kBigHeads + h) * kBigD], kBigD * 2);
      std::memcpy(&want[(slots[t] * 2 * kBigHeads + 2 * h + 1) * kBigD], &values[(t * kBigHeads + h) * kBigD],
                  kBigD * 2);
    }
  }
  KvCacheUpdateParams params;
  params.cache = {cache.data(), DType::kBFloat16, {pages, kBigPageSize, 2 * kBigHeads, kBigD},
                  {kBigPageSize * kRow, kRow, kBigD, 1}};
  params.keys = {keys.data(), DType::kBFloat16, {tokens, kBigHeads, kBigD}, {kBigHeads * kBigD, kBigD, 1}};
  params.values = {values.data(), DType::kBFloat16, {tokens, kBigHeads, kBigD}, {kBigHeads * kBigD, kBigD, 1}};
  params.slots = {slots.data(), true, tokens, 1};
  SetParallelBackend(&testing::TwoThreadBackend);
  const Status status = KvCacheUpdate(params);
  SetParallelBackend(nullptr);
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_TRUE(cache == want);
}

TEST(KvCacheUpdateTest, BadSlotsAreErrorsAndWriteNothing) {
  const struct {
    std::vector<int64_t> slots;
    const char* message;
  } cases[] = {
      {{4, -1, 21, 0, 13, 7}, "slot_mapping[2] must be -1 (skip) or in [0, 21) (total_pages * page_size), got 21"},
      {{4, -2, 20, 0, 13, 7}, "slot_mapping[1] must be -1 (skip) or in [0, 21)"},
      {{4, -1, 20, 0, 13, 4}, "got slot 4 for tokens 0 and 5"},  // unsorted: found by the set
      {{1, 2, 2, -1, -1, -1}, "got slot 2 for tokens 1 and 2"},
  };
  for (const auto& c : cases) {
    Problem p = MakeProblem();
    p.slots = c.slots;
    std::vector<double> got;
    const Status status = RunKernel(DType::kFloat32, true, p, &got);
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find(c.message), std::string::npos) << status.message();
    EXPECT_EQ(got, p.cache) << "a failed call wrote the cache";
  }
}

TEST(KvCacheUpdateTest, CheckSlotsAcceptsPaddingAndEmpty) {
  const std::vector<int64_t> slots = {-1, 3, -1, 1};
  KvCacheSlots view{slots.data(), true, 4, 1};
  EXPECT_TRUE(CheckKvCacheSlots(view, 4).ok());
  view.count = 0;
  EXPECT_TRUE(CheckKvCacheSlots(view, 0).ok());
}

// The duplicate set past its on-stack size (a heap table), and slots that collide in it: a
// duplicate anywhere is found, distinct slots never are.
TEST(KvCacheUpdateTest, CheckSlotsFindsDuplicatesInLargeShuffledSets) {
  const int64_t count = 3000, num_slots = int64_t{1} << 40;
  std::vector<int64_t> slots(static_cast<size_t>(count));
  // Multiples of a power of two in reverse order: never increasing, many equal low bits.
  for (int64_t t = 0; t < count; ++t) slots[static_cast<size_t>(t)] = (count - t) << 20;
  KvCacheSlots view{slots.data(), true, count, 1};
  EXPECT_TRUE(CheckKvCacheSlots(view, num_slots).ok());
  slots[2999] = slots[17];
  const Status status = CheckKvCacheSlots(view, num_slots);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("for tokens 17 and 2999"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace tokamax
