// moe_permute against a std::stable_sort oracle: int32 and int64 ids, a transposed layout, sizes
// spanning several sort chunks, two threads; bad ids leave the outputs untouched.
#include "csrc/ops/moe_gather/moe_gather.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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

namespace tokamax {
namespace {

// ragged_gather_reduce and its backward against a float64 loop: every dtype of x, fp32 weights,
// a strided x, masked rows whose indices are out of range (never read), one and two threads.
struct GatherReduceProblem {
  int64_t rows = 9, hidden = 700, tokens = 6, g = 3;  // hidden > one 512-column tile
  std::vector<double> x, dout, weights;
  std::vector<int32_t> indices;
  std::vector<uint8_t> valid;
};

GatherReduceProblem MakeGatherReduceProblem() {
  GatherReduceProblem p;
  std::mt19937 rng(5);
  auto uniform = [&] { return static_cast<double>(static_cast<int>(rng() % 17) - 8) / 8; };  // exact in bf16
  p.x.resize(p.rows * p.hidden);
  p.dout.resize(p.tokens * p.hidden);
  for (auto& v : p.x) v = uniform();
  for (auto& v : p.dout) v = uniform();
  for (int64_t j = 0; j < p.tokens * p.g; ++j) {
    p.valid.push_back(j % 4 != 1);
    p.indices.push_back(p.valid.back() ? static_cast<int32_t>(rng() % p.rows) : 1000);
    p.weights.push_back(uniform());
  }
  return p;
}

TEST(RaggedGatherReduce, ForwardAndBackwardMatchFloat64Loop) {
  const GatherReduceProblem p = MakeGatherReduceProblem();
  const int64_t n = p.tokens * p.g;
  std::vector<double> want(p.tokens * p.hidden, 0), want_dx(p.rows * p.hidden, 0), want_dw(n, 0);
  for (int64_t j = 0; j < n; ++j) {
    if (!p.valid[j]) continue;
    for (int64_t h = 0; h < p.hidden; ++h) {
      want[(j / p.g) * p.hidden + h] += p.weights[j] * p.x[p.indices[j] * p.hidden + h];
      want_dx[p.indices[j] * p.hidden + h] += p.weights[j] * p.dout[(j / p.g) * p.hidden + h];
      want_dw[j] += p.dout[(j / p.g) * p.hidden + h] * p.x[p.indices[j] * p.hidden + h];
    }
  }
  for (int threads : {1, 2}) {
    if (threads == 2) SetParallelBackend(&testing::TwoThreadBackend);
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
      // x stored transposed: [H, R] memory, [R, H] view.
      testing::Buffer x(dtype, p.rows * p.hidden, 1), dout(dtype, p.tokens * p.hidden), out(dtype, p.tokens * p.hidden),
          dx(dtype, p.rows * p.hidden), weights(DType::kFloat32, n), dw(DType::kFloat32, n);
      for (int64_t r = 0; r < p.rows; ++r) {
        for (int64_t h = 0; h < p.hidden; ++h) x.Set(h * p.rows + r, float(p.x[r * p.hidden + h]));
      }
      for (size_t i = 0; i < p.dout.size(); ++i) dout.Set(i, float(p.dout[i]));
      for (int64_t j = 0; j < n; ++j) weights.Set(j, float(p.weights[j]));
      RaggedGatherReduceParams params;
      params.x = {x.data(), dtype, {p.rows, p.hidden}, {1, p.rows}};
      params.indices = {p.indices.data(), false, n, 1};
      params.topk_weights = {weights.data(), DType::kFloat32, {n}, {1}};
      params.valid = p.valid.data();
      params.group_size = p.g;
      params.out = {out.data(), dtype, {p.tokens, p.hidden}, {p.hidden, 1}};
      params.dout = {dout.data(), dtype, {p.tokens, p.hidden}, {p.hidden, 1}};
      params.dx = {dx.data(), dtype, {p.rows, p.hidden}, {p.hidden, 1}};
      params.dtopk_weights = {dw.data(), DType::kFloat32, {n}, {1}};
      ASSERT_TRUE(RaggedGatherReduce(params).ok());
      ASSERT_TRUE(RaggedGatherReduceBackward(params).ok());
      const double tol = testing::Tolerance(dtype);
      for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(out.Get(i), want[i], tol * (1 + std::abs(want[i]))) << i;
      for (size_t i = 0; i < want_dx.size(); ++i) EXPECT_NEAR(dx.Get(i), want_dx[i], tol * (1 + std::abs(want_dx[i])));
      for (int64_t j = 0; j < n; ++j) EXPECT_NEAR(dw.Get(j), want_dw[j], 1e-4 * (1 + std::abs(want_dw[j])));
    }
    SetParallelBackend(nullptr);
  }
}

TEST(RaggedGatherReduce, BadIndexOrGroupSizeErrorsBeforeAnyWrite) {
  std::vector<float> x(4 * 2, 1.0f), out(2 * 2, -7.0f), weights(4, 1.0f);
  std::vector<int64_t> indices = {0, 3, 4, 1};
  std::vector<uint8_t> valid = {1, 1, 1, 1};
  RaggedGatherReduceParams params;
  params.x = {x.data(), DType::kFloat32, {4, 2}, {2, 1}};
  params.indices = {indices.data(), true, 4, 1};
  params.topk_weights = {weights.data(), DType::kFloat32, {4}, {1}};
  params.valid = valid.data();
  params.group_size = 2;
  params.out = {out.data(), DType::kFloat32, {2, 2}, {2, 1}};
  Status status = RaggedGatherReduce(params);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("indices[2] must be in [0, R=4)"), std::string::npos) << status.message();
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == -7.0f; }));
  valid[2] = 0;  // masked: its index is not read
  EXPECT_TRUE(RaggedGatherReduce(params).ok());
  params.group_size = 3;
  EXPECT_FALSE(RaggedGatherReduce(params).ok());
}

}  // namespace
}  // namespace tokamax

namespace tokamax {
namespace {

// ragged_gather (rows start <= j < end) and ragged_scatter (start <= indices[j] < end): the reduce
// kernels with g = 1, no weights and no mask. Exact copies; dx sums the selected rows of dout.
TEST(RaggedGather, PositionAndIndexRulesCopyExactlyAndSumGradients) {
  const int64_t rows = 5, hidden = 3, n = 6;
  std::vector<float> x(rows * hidden), dout(n * hidden, 1.0f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) - 0.5f;
  x[0] = -0.0f;
  std::vector<int32_t> indices = {9, 0, 2, 2, 4, -3};
  for (RowRange range : {RowRange::kPosition, RowRange::kIndex}) {
    std::vector<float> out(n * hidden, -7.0f), dx(rows * hidden, -7.0f);
    RaggedGatherReduceParams params;
    params.op = "ragged_gather";
    params.x = {x.data(), DType::kFloat32, {rows, hidden}, {hidden, 1}};
    params.indices = {indices.data(), false, n, 1};
    params.range = range;
    params.start = range == RowRange::kPosition ? 1 : 0;
    params.end = range == RowRange::kPosition ? 5 : 3;  // kIndex: rows 0..2 of x
    params.out = {out.data(), DType::kFloat32, {n, hidden}, {hidden, 1}};
    params.dout = {dout.data(), DType::kFloat32, {n, hidden}, {hidden, 1}};
    params.dx = {dx.data(), DType::kFloat32, {rows, hidden}, {hidden, 1}};
    ASSERT_TRUE(RaggedGatherReduce(params).ok());
    ASSERT_TRUE(RaggedGatherReduceBackward(params).ok());
    for (int64_t j = 0; j < n; ++j) {
      const bool kept = range == RowRange::kPosition ? (j >= 1 && j < 5) : (indices[j] >= 0 && indices[j] < 3);
      for (int64_t h = 0; h < hidden; ++h) {
        const float want = kept ? x[indices[j] * hidden + h] : 0.0f;
        EXPECT_EQ(std::memcmp(&out[j * hidden + h], &want, sizeof(float)), 0) << j << " " << h;  // -0.0 too
      }
    }
    const std::vector<float> want_dx_row = range == RowRange::kPosition ? std::vector<float>{1, 0, 2, 0, 1}
                                                                        : std::vector<float>{1, 0, 2, 0, 0};
    for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(dx[r * hidden], want_dx_row[r]) << r;
    params.end = range == RowRange::kPosition ? n + 1 : rows + 1;
    std::fill(out.begin(), out.end(), -7.0f);
    EXPECT_FALSE(RaggedGatherReduce(params).ok());
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == -7.0f; }));
  }
}

}  // namespace
}  // namespace tokamax
