// router_topk and topk on every supported tier and dtype against a stable-sort oracle: exact
// values and ids, ties, NaN / -inf / -FLT_MAX, short and empty rows, strided rows, two threads.
#include "csrc/ops/topk/topk.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/base/test_util.h"
#include "csrc/core/runtime/cpu_info.h"

namespace tokamax {
namespace {

using testing::Buffer;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// One row's selection by a stable sort of (key descending, column ascending): the oracle.
// Router keys clamp NaN and <= floor to the floor; topk's ineligible columns are dropped.
std::vector<std::pair<float, int32_t>> Oracle(const std::vector<float>& row, int64_t k, bool router, int64_t length) {
  std::vector<std::pair<float, int32_t>> keys;
  for (int64_t c = 0; c < length; ++c) {
    const float v = row[c];
    if (router) {
      keys.push_back({v > kRouterTopKFloor ? v : kRouterTopKFloor, static_cast<int32_t>(c)});
    } else if (v > -kInf) {
      keys.push_back({v, static_cast<int32_t>(c)});
    }
  }
  std::stable_sort(keys.begin(), keys.end(), [](auto a, auto b) { return a.first > b.first; });
  keys.resize(std::min<int64_t>(k, keys.size()));
  if (router && keys[0].first <= kRouterTopKFloor) {
    for (auto& key : keys) key.first = kNaN;
  }
  while (static_cast<int64_t>(keys.size()) < k) keys.push_back({-kInf, -1});
  return keys;
}

// Scores with many ties (few distinct values) and, in some rows, NaN, -inf, -FLT_MAX and +inf.
std::vector<float> Scores(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> level(-8, 8), special(0, 40);
  const float specials[] = {kNaN, -kInf, -std::numeric_limits<float>::max(), kInf, -3.1e38f, kRouterTopKFloor};
  std::vector<float> scores(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const int mode = r % 5;  // 0: clean, 1: specials sprinkled, 2: mostly bad, 3: all bad, 4: all equal
    for (int64_t c = 0; c < cols; ++c) {
      float v = 0.25f * level(rng);
      if (mode == 1 && special(rng) < 6) v = specials[special(rng) % 6];
      if (mode == 2 && special(rng) < 36) v = specials[special(rng) % 3];
      if (mode == 3) v = specials[(r + c) % 3];
      if (mode == 4) v = 1.5f;
      scores[r * cols + c] = v;
    }
  }
  return scores;
}

// The scores in `dtype` (values are exact in every dtype but the fp16 overflow specials, which
// become -inf: the oracle reads them back), rows contiguous or transposed (column-major).
struct Problem {
  Problem(DType dtype, int64_t rows, int64_t cols, bool transposed, uint32_t seed)
      : buffer(dtype, rows * cols, /*misalign=*/1), rows(rows), cols(cols), transposed(transposed) {
    const std::vector<float> values = Scores(rows, cols, seed);
    scores.resize(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t at = transposed ? c * rows + r : r * cols + c;
        buffer.Set(at, values[r * cols + c]);
        scores[r * cols + c] = buffer.Get(at);
      }
    }
    view.data = buffer.data();
    view.dtype = dtype;
    view.sizes[0] = rows;
    view.sizes[1] = cols;
    view.strides[0] = transposed ? 1 : cols;
    view.strides[1] = transposed ? rows : 1;
  }
  std::vector<float> Row(int64_t r) const { return {scores.begin() + r * cols, scores.begin() + (r + 1) * cols}; }

  Buffer buffer;
  int64_t rows, cols;
  bool transposed;
  std::vector<float> scores;
  StridedView<2> view;
};

bool SameFloat(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

class TopKTest : public ::testing::TestWithParam<std::tuple<Isa, DType>> {
 protected:
  void SetUp() override {
    if (!IsaSupported(std::get<0>(GetParam()), GetCpuInfo())) GTEST_SKIP() << "tier not supported here";
    SetParallelBackend(&testing::TwoThreadBackend);
  }
  void TearDown() override { SetParallelBackend(nullptr); }
};

TEST_P(TopKTest, RouterTopKMatchesTheStableSortOracle) {
  const auto [isa, dtype] = GetParam();
  testing::ScopedIsa scoped(isa);
  for (auto [rows, cols, k] : {std::tuple<int64_t, int64_t, int64_t>{40, 64, 8}, {23, 37, 5}, {10, 16, 16},
                               {7, 300, 10}, {5, 3, 1}, {12, 257, 64}}) {
    for (bool transposed : {false, true}) {
      Problem problem(dtype, rows, cols, transposed, static_cast<uint32_t>(rows * cols + k));
      std::vector<float> weights(rows * k, -1.0f);
      std::vector<int32_t> indices(rows * k, -7);
      RouterTopKParams params{problem.view, k, weights.data(), indices.data()};
      const Status status = RouterTopK(params);
      ASSERT_TRUE(status.ok()) << status.message();
      for (int64_t r = 0; r < rows; ++r) {
        const auto want = Oracle(problem.Row(r), k, /*router=*/true, cols);
        for (int64_t j = 0; j < k; ++j) {
          ASSERT_EQ(indices[r * k + j], want[j].second) << "row " << r << " slot " << j << " " << cols << "x" << k;
          ASSERT_TRUE(SameFloat(weights[r * k + j], want[j].first))
              << "row " << r << " slot " << j << ": " << weights[r * k + j] << " want " << want[j].first;
        }
      }
    }
  }
}

TEST_P(TopKTest, TopKMatchesTheStableSortOracle) {
  const auto [isa, dtype] = GetParam();
  testing::ScopedIsa scoped(isa);
  for (auto [rows, cols, k] : {std::tuple<int64_t, int64_t, int64_t>{40, 64, 8}, {23, 37, 5}, {10, 16, 16},
                               {7, 300, 10}, {5, 3, 1}, {12, 257, 64}}) {
    for (bool transposed : {false, true}) {
      for (bool ragged : {false, true}) {
        Problem problem(dtype, rows, cols, transposed, static_cast<uint32_t>(rows + cols * k));
        std::vector<int32_t> lengths(rows);
        for (int64_t r = 0; r < rows; ++r) lengths[r] = static_cast<int32_t>((r * 7919) % (cols + 3)) - 1;
        Buffer values(dtype, rows * k);
        std::vector<int32_t> indices(rows * k, -7);
        TopKParams params;
        params.scores = problem.view;
        params.k = k;
        params.row_lengths = ragged ? lengths.data() : nullptr;
        params.indices = indices.data();
        params.values = values.data();
        const Status status = TopK(params);
        ASSERT_TRUE(status.ok()) << status.message();
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t length = ragged ? std::clamp<int64_t>(lengths[r], 0, cols) : cols;
          const auto want = Oracle(problem.Row(r), k, /*router=*/false, length);
          for (int64_t j = 0; j < k; ++j) {
            ASSERT_EQ(indices[r * k + j], want[j].second) << "row " << r << " slot " << j;
            ASSERT_TRUE(SameFloat(values.Get(r * k + j), want[j].first)) << "row " << r << " slot " << j;
          }
        }
        // Without values: the same indices.
        std::vector<int32_t> again(rows * k, -7);
        params.indices = again.data();
        params.values = nullptr;
        ASSERT_TRUE(TopK(params).ok());
        EXPECT_EQ(again, indices);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    TiersAndDtypes, TopKTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16)),
    [](const auto& info) {
      return std::string(IsaName(std::get<0>(info.param))) + "_" + DTypeName(std::get<1>(info.param));
    });

TEST(TopKErrors, BadKAndDtypeAreReported) {
  std::vector<float> scores(12, 0.0f);
  std::vector<float> weights(20);
  std::vector<int32_t> indices(20);
  RouterTopKParams router{{scores.data(), DType::kFloat32, {3, 4}, {4, 1}}, 5, weights.data(), indices.data()};
  EXPECT_EQ(RouterTopK(router).message(), "router_topk: k must be in [1, E=4], got 5");
  router.k = 0;
  EXPECT_EQ(RouterTopK(router).message(), "router_topk: k must be in [1, E=4], got 0");
  router.k = 2;
  router.scores.dtype = DType::kFloat64;
  EXPECT_EQ(RouterTopK(router).message(), "router_topk: scores must be float32, bfloat16 or float16, got float64");
  TopKParams topk;
  topk.scores = {scores.data(), DType::kFloat32, {3, 4}, {4, 1}};
  topk.k = 5;
  topk.indices = indices.data();
  EXPECT_EQ(TopK(topk).message(), "topk: k must be in [1, n=4], got 5");
}

}  // namespace
}  // namespace tokamax
