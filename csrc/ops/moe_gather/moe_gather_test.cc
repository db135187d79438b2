// moe_permute against a std::stable_sort oracle: int32 and int64 ids, a transposed layout, sizes
// spanning several sort chunks, two threads; bad ids leave the outputs untouched.
#include "csrc/ops/moe_gather/moe_gather.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/base/test_util.h"

namespace tokamax {
namespace {

struct Permutation {
  std::vector<int64_t> order, inverse;
  std::vector<int32_t> group_sizes;
};

// ids is [T, k] row-major; the kernel reads it through `transposed` strides when asked
// (stored [k, T]).
Status RunPermute(const std::vector<int64_t>& ids, int64_t tokens, int64_t k, int64_t experts, bool int64_ids,
           bool transposed, Permutation* out) {
  std::vector<int64_t> wide(ids.size());
  std::vector<int32_t> narrow(ids.size());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t s = 0; s < k; ++s) {
      const int64_t at = transposed ? s * tokens + t : t * k + s;
      wide[at] = ids[t * k + s];
      narrow[at] = static_cast<int32_t>(ids[t * k + s]);
    }
  }
  out->order.assign(ids.size(), -7);
  out->inverse.assign(ids.size(), -7);
  out->group_sizes.assign(experts, -7);
  MoePermuteParams params;
  params.expert_indices = {int64_ids ? static_cast<const void*>(wide.data()) : narrow.data(), int64_ids, tokens, k,
                           transposed ? 1 : k, transposed ? tokens : 1};
  params.num_experts = experts;
  params.order = out->order.data();
  params.inverse = out->inverse.data();
  params.group_sizes = out->group_sizes.data();
  return MoePermute(params);
}

void ExpectMatchesStableSort(const std::vector<int64_t>& ids, int64_t experts, const Permutation& got) {
  std::vector<int64_t> order(ids.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  EXPECT_EQ(got.order, order);
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(got.inverse[order[i]], static_cast<int64_t>(i));
  std::vector<int32_t> sizes(experts, 0);
  for (int64_t id : ids) ++sizes[id];
  EXPECT_EQ(got.group_sizes, sizes);
}

TEST(MoePermute, MatchesStableSortAcrossLayoutsDtypesAndThreads) {
  std::mt19937 rng(3);
  for (int threads : {1, 2}) {
    if (threads == 2) SetParallelBackend(&testing::TwoThreadBackend);
    for (auto [tokens, k, experts] : {std::tuple<int64_t, int64_t, int64_t>{7, 2, 4}, {0, 3, 5}, {5000, 8, 64},
                                      {40000, 1, 3}, {3, 4, 1000}}) {
      std::vector<int64_t> ids(tokens * k);
      // Skewed: half the ids go to expert 0, so long runs of ties cross chunk boundaries.
      for (auto& id : ids) id = rng() % 2 ? 0 : static_cast<int64_t>(rng() % experts);
      for (bool int64_ids : {false, true}) {
        for (bool transposed : {false, true}) {
          Permutation got;
          ASSERT_TRUE(RunPermute(ids, tokens, k, experts, int64_ids, transposed, &got).ok());
          ExpectMatchesStableSort(ids, experts, got);
        }
      }
    }
    SetParallelBackend(nullptr);
  }
}

TEST(MoePermute, BadIdsErrorBeforeAnyWrite) {
  std::vector<int64_t> ids(40000, 1);
  ids[30001] = 4;
  ids[35000] = -1;
  Permutation got;
  const Status status = RunPermute(ids, 20000, 2, 4, true, false, &got);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("expert_indices[15000, 1] must be in [0, num_experts=4), got 4"), std::string::npos)
      << status.message();
  EXPECT_TRUE(std::all_of(got.order.begin(), got.order.end(), [](int64_t v) { return v == -7; }));
  EXPECT_TRUE(std::all_of(got.inverse.begin(), got.inverse.end(), [](int64_t v) { return v == -7; }));
  EXPECT_TRUE(std::all_of(got.group_sizes.begin(), got.group_sizes.end(), [](int32_t v) { return v == -7; }));
  EXPECT_FALSE(RunPermute({0, 1}, 1, 2, 0, true, false, &got).ok());
}

}  // namespace
}  // namespace tokamax
