#include "csrc/ops/ragged_dot/ragged_dot.h"

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/runtime/isa.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/core/base/test_util.h"

namespace tokamax {
namespace {

using testing::Buffer;
using testing::ScopedIsa;

struct Problem {
  RaggedDotForm form;
  int64_t m, k, n;
  std::vector<int64_t> group_sizes;
};

// Builds contiguous operands for `problem` (lhs strided by an extra column when `strided`),
// runs the kernel with `config` and the float64 reference, and compares them.
void Check(const Problem& pb, DType dtype, const RaggedDotConfig& config, bool strided) {
  const int64_t g = static_cast<int64_t>(pb.group_sizes.size());
  const int64_t lhs_cols = pb.k + (strided ? 1 : 0);
  Buffer lhs(dtype, pb.m * lhs_cols, 1);
  testing::FillRandom(lhs, pb.m * lhs_cols, 11);
  RaggedDotParams p;
  p.form = pb.form;
  p.lhs = {lhs.data(), dtype, {pb.m, pb.k, 0}, {lhs_cols, 1, 0}};
  int64_t rhs_count = 0, out_count = 0;
  switch (pb.form) {
    case RaggedDotForm::kDefault:
      rhs_count = g * pb.k * pb.n;
      out_count = pb.m * pb.n;
      break;
    case RaggedDotForm::kTransRhs:
      rhs_count = g * pb.n * pb.k;
      out_count = pb.m * pb.n;
      break;
    case RaggedDotForm::kRaggedContracting:
      rhs_count = pb.m * pb.n;
      out_count = g * pb.k * pb.n;
      break;
  }
  Buffer rhs(dtype, rhs_count, 3);
  testing::FillRandom(rhs, rhs_count, 12);
  switch (pb.form) {
    case RaggedDotForm::kDefault:
      p.rhs = {rhs.data(), dtype, {g, pb.k, pb.n}, {pb.k * pb.n, pb.n, 1}};
      p.out_strides[0] = pb.n;
      p.out_strides[1] = 1;
      break;
    case RaggedDotForm::kTransRhs:
      p.rhs = {rhs.data(), dtype, {g, pb.n, pb.k}, {pb.n * pb.k, pb.k, 1}};
      p.out_strides[0] = pb.n;
      p.out_strides[1] = 1;
      break;
    case RaggedDotForm::kRaggedContracting:
      p.rhs = {rhs.data(), dtype, {pb.m, pb.n, 0}, {pb.n, 1, 0}};
      p.out_strides[0] = pb.k * pb.n;
      p.out_strides[1] = pb.n;
      p.out_strides[2] = 1;
      break;
  }
  p.group_sizes = pb.group_sizes.data();
  p.num_groups = g;
  p.out_dtype = dtype;

  Buffer got(dtype, out_count, 1), want(dtype, out_count);
  testing::Poison(got, out_count);
  testing::Poison(want, out_count);
  p.out = got.data();
  const Status status = RaggedDot(p, config);
  ASSERT_TRUE(status.ok()) << status.message();
  p.out = want.data();
  RaggedDotReference(p);
  EXPECT_LE(testing::RelativeError(got, want, out_count), testing::Tolerance(dtype))
      << RaggedDotFormName(pb.form) << " m=" << pb.m << " k=" << pb.k << " n=" << pb.n << " g=" << g;
}

class RaggedDotTest : public ::testing::TestWithParam<std::tuple<Isa, DType>> {
 protected:
  void SetUp() override {
    if (!IsaSupported(std::get<0>(GetParam()), GetCpuInfo())) GTEST_SKIP() << "tier not supported";
  }
};

RaggedDotConfig SmallConfig() {
  RaggedDotConfig c;
  c.block_m = 6;
  c.block_k = 5;
  c.block_n = 16;
  c.task_m = 12;
  c.pack_b_min_rows = 4;
  return c;
}

TEST_P(RaggedDotTest, AllFormsMatchReference) {
  const auto [isa, dtype] = GetParam();
  ScopedIsa scoped(isa);
  SetParallelBackend(&testing::TwoThreadBackend);
  const std::vector<Problem> problems = {
      {RaggedDotForm::kDefault, 37, 19, 23, {5, 0, 13, 1, 9}},   // 9 tail rows
      {RaggedDotForm::kDefault, 8, 3, 40, {0, 0, 0}},            // all groups empty
      {RaggedDotForm::kDefault, 50, 33, 17, {50}},               // one group owns all rows
      {RaggedDotForm::kTransRhs, 41, 21, 35, {7, 20, 0, 10}},
      {RaggedDotForm::kRaggedContracting, 40, 13, 29, {3, 0, 25, 8}},
      {RaggedDotForm::kRaggedContracting, 6, 7, 18, {0, 0}},
      {RaggedDotForm::kDefault, 130, 70, 100, {60, 70}},
  };
  for (const Problem& pb : problems) {
    for (bool strided : {false, true}) {
      Check(pb, dtype, SmallConfig(), strided);
      const RaggedDotShape shape{pb.form, pb.m, pb.k, pb.n, static_cast<int64_t>(pb.group_sizes.size())};
      Check(pb, dtype, RaggedDotHeuristicConfig(shape, dtype, GetCpuInfo(), RaggedDotProduct::kForward), strided);
    }
  }
  SetParallelBackend(nullptr);
}

TEST_P(RaggedDotTest, EveryConfigOfTheSpaceMatches) {
  const auto [isa, dtype] = GetParam();
  ScopedIsa scoped(isa);
  const Problem pb{RaggedDotForm::kDefault, 45, 40, 50, {20, 0, 22}};
  const RaggedDotShape shape{pb.form, pb.m, pb.k, pb.n, 3};
  const auto space = RaggedDotConfigSpace(shape, dtype, GetCpuInfo(), RaggedDotProduct::kForward);
  ASSERT_GT(space.size(), 5u);
  EXPECT_EQ(space.front(), RaggedDotHeuristicConfig(shape, dtype, GetCpuInfo(), RaggedDotProduct::kForward));
  for (const RaggedDotConfig& config : space) {
    ASSERT_TRUE(config.Validate().ok()) << config.Validate().message();
    Check(pb, dtype, config, false);
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllTiers, RaggedDotTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16)),
    [](const auto& info) {
      return std::string(IsaName(std::get<0>(info.param))) + "_" + DTypeName(std::get<1>(info.param));
    });

TEST(RaggedDotConfigTest, RejectsBadFieldsByName) {
  RaggedDotConfig c;
  c.block_m = 0;
  EXPECT_NE(c.Validate().message().find("block_m"), std::string::npos);
  c = RaggedDotConfig();
  c.block_n = 1000000000;
  EXPECT_NE(c.Validate().message().find("block_n"), std::string::npos);
  c = RaggedDotConfig();
  c.task_m = c.block_m + 1;
  EXPECT_NE(c.Validate().message().find("task_m"), std::string::npos);
  RaggedDotConfig parsed;
  EXPECT_FALSE(RaggedDotConfig::FromVector({1, 2, 3}, &parsed).ok());
  EXPECT_TRUE(RaggedDotConfig::FromVector(RaggedDotConfig().ToVector(), &parsed).ok());
}

TEST(RaggedDotConfigTest, EachGradientProductIsTheForwardOfItsOwnShape) {
  // The backward runs each gradient as a ragged_dot call with no config, which picks the forward
  // heuristic of that call's shape: get_configs's per-product heuristic must be the same.
  const CpuInfo& cpu = GetCpuInfo();
  const RaggedDotShape call{RaggedDotForm::kDefault, 512, 96, 1000, 4};
  const RaggedDotShape dlhs = RaggedDotProductShape(call, RaggedDotProduct::kDlhs);
  const RaggedDotShape drhs = RaggedDotProductShape(call, RaggedDotProduct::kDrhs);
  EXPECT_EQ(dlhs.form, RaggedDotForm::kTransRhs);
  EXPECT_EQ((std::vector<int64_t>{dlhs.m, dlhs.k, dlhs.n, dlhs.g}), (std::vector<int64_t>{512, 1000, 96, 4}));
  EXPECT_EQ(drhs.form, RaggedDotForm::kRaggedContracting);
  EXPECT_EQ((std::vector<int64_t>{drhs.m, drhs.k, drhs.n, drhs.g}), (std::vector<int64_t>{512, 96, 1000, 4}));
  for (RaggedDotProduct product : {RaggedDotProduct::kForward, RaggedDotProduct::kDlhs, RaggedDotProduct::kDrhs}) {
    const RaggedDotShape shape = RaggedDotProductShape(call, product);
    EXPECT_EQ(RaggedDotHeuristicConfig(call, DType::kFloat32, cpu, product),
              RaggedDotHeuristicConfig(shape, DType::kFloat32, cpu, RaggedDotProduct::kForward));
    EXPECT_EQ(RaggedDotConfigSpace(call, DType::kFloat32, cpu, product).front(),
              RaggedDotHeuristicConfig(call, DType::kFloat32, cpu, product));
  }
  // The two gradient products differ in shape, and so here in config.
  EXPECT_NE(RaggedDotHeuristicConfig(call, DType::kFloat32, cpu, RaggedDotProduct::kDlhs),
            RaggedDotHeuristicConfig(call, DType::kFloat32, cpu, RaggedDotProduct::kDrhs));
}

TEST(RaggedDotConfigTest, HeuristicIsValidAcrossShapes) {
  for (RaggedDotForm form : {RaggedDotForm::kDefault, RaggedDotForm::kTransRhs, RaggedDotForm::kRaggedContracting}) {
    for (int64_t m : {0, 1, 64, 4096, 1 << 20}) {
      for (int64_t kn : {0, 1, 17, 1024, 16384}) {
        for (int64_t g : {0, 1, 8, 256}) {
          const RaggedDotShape shape{form, m, kn, kn + 3, g};
          for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
            for (RaggedDotProduct product :
                 {RaggedDotProduct::kForward, RaggedDotProduct::kDlhs, RaggedDotProduct::kDrhs}) {
              const Status s = RaggedDotHeuristicConfig(shape, dtype, GetCpuInfo(), product).Validate();
              EXPECT_TRUE(s.ok()) << s.message();
            }
          }
        }
      }
    }
  }
}

TEST(RaggedDotGroupSizesTest, RejectsNegativeAndOversizedSums) {
  const std::vector<int64_t> negative = {3, -1};
  EXPECT_NE(CheckRaggedDotGroupSizes(negative.data(), 2, 10).message().find("non-negative"), std::string::npos);
  const std::vector<int64_t> too_many = {6, 5};
  EXPECT_NE(CheckRaggedDotGroupSizes(too_many.data(), 2, 10).message().find("got 11"), std::string::npos);
  const std::vector<int64_t> huge = {INT64_MAX, INT64_MAX};
  EXPECT_FALSE(CheckRaggedDotGroupSizes(huge.data(), 2, 10).ok());
  const std::vector<int64_t> fine = {4, 0, 6};
  EXPECT_TRUE(CheckRaggedDotGroupSizes(fine.data(), 3, 10).ok());
}

TEST(RaggedDotDimensionNumbersTest, ParsesTheThreeFormsOnly) {
  for (RaggedDotForm form : {RaggedDotForm::kDefault, RaggedDotForm::kTransRhs, RaggedDotForm::kRaggedContracting}) {
    RaggedDotForm parsed;
    ASSERT_TRUE(ParseRaggedDotDimensionNumbers(RaggedDotDimensionNumbers(form), &parsed).ok());
    EXPECT_EQ(parsed, form);
  }
  RaggedDotForm parsed;
  EXPECT_FALSE(ParseRaggedDotDimensionNumbers({1, 1, 0, 0, 1, 1, 0, 0, 0, 0}, &parsed).ok());
}

}  // namespace
}  // namespace tokamax
