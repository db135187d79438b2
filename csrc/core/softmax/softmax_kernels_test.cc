// The online softmax step of the column softmax tables (softmax_kernels.h) on every tier.
#include "csrc/core/softmax/softmax_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/base/test_util.h"
#include "csrc/core/runtime/cpu_info.h"

namespace tokamax {
namespace {

using testing::Buffer;

// The online softmax over two tiles (UpdateRunningMax, then exp_columns and alpha as attention
// applies them) gives each column's max and sum of exp over both tiles, as a float64 pass over
// all rows at once does; a column that sees only -inf keeps sum 0 and sub 0.
TEST(OnlineSoftmaxTest, TwoTilesEqualOnePassInFloat64) {
  const int64_t rows = 7, cols = 16, ld = 20;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> x(2 * rows * ld);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 3.0f * std::sin(0.37 * i) + (i < rows * ld ? -2.0f : 1.0f);
  for (int64_t r = 0; r < 2 * rows; ++r) x[r * ld + 5] = kNegInf;  // column 5: fully masked
  for (int64_t r = 0; r < rows; ++r) x[r * ld + 9] = kNegInf;      // column 9: masked in tile 1 only
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa, GetCpuInfo())) continue;
    const SoftmaxKernels& kernels = GetSoftmaxKernels(isa);
    std::vector<float> max(cols, kNegInf), sum(cols, 0.0f), alpha(cols), sub(cols), tile_max(cols);
    std::vector<float> tiles = x;
    for (int64_t tile = 0; tile < 2; ++tile) {
      float* t = tiles.data() + tile * rows * ld;
      UpdateRunningMax(kernels, t, rows, ld, cols, max.data(), sum.data(), alpha.data(), sub.data(), tile_max.data());
      kernels.exp_columns(t, rows, ld, cols, sub.data(), sum.data());
    }
    for (int64_t c = 0; c < cols; ++c) {
      double want_max = -INFINITY, want_sum = 0.0;
      for (int64_t r = 0; r < 2 * rows; ++r) want_max = std::max<double>(want_max, x[r * ld + c]);
      if (want_max != -INFINITY) {
        for (int64_t r = 0; r < 2 * rows; ++r) want_sum += std::exp(double(x[r * ld + c]) - want_max);
      }
      EXPECT_EQ(max[c], static_cast<float>(want_max)) << IsaName(isa) << " column " << c;
      EXPECT_NEAR(sum[c], want_sum, 1e-5 * std::max(1.0, want_sum)) << IsaName(isa) << " column " << c;
    }
    EXPECT_EQ(sum[5], 0.0f);
    EXPECT_EQ(sub[5], 0.0f);
  }
}

class WidenRowTest : public ::testing::TestWithParam<std::tuple<Isa, DType>> {};

TEST_P(WidenRowTest, IsTheScalarProduct) {
  const auto [isa, dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const SoftmaxKernels& kernels = GetSoftmaxKernels(isa);
  for (int64_t count : {1, 15, 16, 33, 128}) {
    Buffer x(dtype, count, /*misalign=*/1);
    testing::FillRandom(x, count, 13 + count);
    std::vector<float> got(count + 1, std::nanf(""));
    kernels.widen_row(dtype, x.data(), count, 0.125f * 3, got.data());
    for (int64_t h = 0; h < count; ++h) EXPECT_EQ(got[h], 0.375f * x.Get(h)) << "count " << count << " h " << h;
    EXPECT_TRUE(std::isnan(got[count])) << "wrote past count " << count;
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllTiers, WidenRowTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16)),
    [](const auto& info) {
      return std::string(IsaName(std::get<0>(info.param))) + "_" + DTypeName(std::get<1>(info.param));
    });

}  // namespace
}  // namespace tokamax
