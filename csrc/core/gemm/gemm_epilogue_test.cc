// GemmEpilogue (gemm.h) against a float64 oracle on every tier: scale, bias, each activation,
// the down-cast into C's dtype, a row scatter and the per-row online logsumexp, over a region
// whose columns are written by two calls and several column blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/gemm/gemm.h"
#include "csrc/core/base/test_util.h"

namespace tokamax {
namespace {

using testing::Buffer;

const char* ActivationName(Activation activation) {
  switch (activation) {
    case Activation::kNone: return "none";
    case Activation::kRelu: return "relu";
    case Activation::kSilu: return "silu";
    case Activation::kGeluTanh: return "gelu_tanh";
    case Activation::kGeluErf: return "gelu_erf";
    case Activation::kSigmoid: return "sigmoid";
  }
  return "?";
}

class GemmEpilogueTest : public ::testing::TestWithParam<std::tuple<Isa, DType, Activation>> {};

TEST_P(GemmEpilogueTest, MatchesFloat64Oracle) {
  const auto [isa, dtype, activation] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const int64_t m = 23, k = 37, n = 50, split = 20;
  Buffer a(dtype, m * k, 1), b(dtype, k * n, 3);
  testing::FillRandom(a, m * k, 1);
  testing::FillRandom(b, k * n, 2);
  std::vector<float> bias(n);
  for (int64_t j = 0; j < n; ++j) bias[j] = 0.05f * static_cast<float>(j % 7) - 0.1f;
  std::vector<int64_t> row_map(m);
  for (int64_t i = 0; i < m; ++i) row_map[i] = (i * 5) % m;  // 5 and 23 are coprime: a permutation
  std::vector<float> row_max(m, -std::numeric_limits<float>::infinity()), row_sum(m, 0.0f);
  GemmEpilogue epilogue;
  epilogue.scale = 0.75f;
  epilogue.bias = bias.data();
  epilogue.activation = activation;
  epilogue.row_map = row_map.data();
  epilogue.row_max = row_max.data();
  epilogue.row_sum = row_sum.data();
  const ConstMatrix am{a.data(), dtype, m, k, k, 1}, bm{b.data(), dtype, k, n, n, 1};
  Buffer c(dtype, m * n);
  testing::Poison(c, m * n);
  const MutableMatrix cm{c.data(), dtype, m, n, n, 1};
  const GemmBlocking blocking{12, 16, 16, true};  // several row, depth and column blocks
  const GemmKernels& kernels = GetGemmKernels(isa);
  GemmRegion(kernels, am, bm, cm, 0, m, 0, split, blocking, epilogue);
  GemmRegion(kernels, am, bm, cm, 0, m, split, n, blocking, epilogue);

  std::vector<double> product(m * n);
  ReferenceGemm(am, bm, {product.data(), DType::kFloat64, m, n, n, 1});
  Buffer want(dtype, m * n);
  for (int64_t i = 0; i < m; ++i) {
    double max = -std::numeric_limits<double>::infinity(), sum = 0.0;
    std::vector<double> x(n);
    for (int64_t j = 0; j < n; ++j) {
      x[j] = Activate(activation, 0.75 * product[i * n + j] + bias[j]);
      want.Set(row_map[i] * n + j, static_cast<float>(x[j]));
      max = std::max(max, x[j]);
    }
    for (int64_t j = 0; j < n; ++j) sum += std::exp(x[j] - max);
    EXPECT_NEAR(row_max[i], max, 1e-5 * std::max(1.0, std::fabs(max))) << "row " << i;
    EXPECT_NEAR(row_sum[i], sum, 1e-4 * sum) << "row " << i;
  }
  EXPECT_LE(testing::RelativeError(c, want, m * n), testing::Tolerance(dtype));
}

INSTANTIATE_TEST_SUITE_P(
    AllTiers, GemmEpilogueTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16),
                       ::testing::Values(Activation::kNone, Activation::kRelu, Activation::kSilu,
                                         Activation::kGeluTanh, Activation::kGeluErf, Activation::kSigmoid)),
    [](const auto& info) {
      return std::string(IsaName(std::get<0>(info.param))) + "_" + DTypeName(std::get<1>(info.param)) + "_" +
             ActivationName(std::get<2>(info.param));
    });

// The float64 path applies the same epilogue in double.
TEST(GemmEpilogueFloat64Test, ScatterBiasAndActivationInDouble) {
  const int64_t m = 3, k = 2, n = 2;
  const double a[m * k] = {1, 2, -3, 4, 0.5, -1};
  const double b[k * n] = {1, -1, 2, 0.25};
  double c[m * n] = {};
  const float bias[n] = {0.5f, -2.0f};
  const int64_t row_map[m] = {2, 0, 1};
  float row_max[m] = {-INFINITY, -INFINITY, -INFINITY}, row_sum[m] = {0, 0, 0};
  GemmEpilogue e;
  e.scale = 2.0f;
  e.bias = bias;
  e.activation = Activation::kRelu;
  e.row_map = row_map;
  e.row_max = row_max;
  e.row_sum = row_sum;
  GemmRegion(GetGemmKernels(Isa::kScalar), {a, DType::kFloat64, m, k, k, 1}, {b, DType::kFloat64, k, n, n, 1},
             {c, DType::kFloat64, m, n, n, 1}, 0, m, 0, n, GemmBlocking{}, e);
  for (int64_t i = 0; i < m; ++i) {
    double x[n];
    for (int64_t j = 0; j < n; ++j) {
      const double dot = a[i * k] * b[j] + a[i * k + 1] * b[n + j];
      x[j] = std::max(0.0, 2.0 * dot + bias[j]);
      EXPECT_EQ(c[row_map[i] * n + j], x[j]) << i << " " << j;
    }
    const double max = std::max(x[0], x[1]);
    EXPECT_FLOAT_EQ(row_max[i], static_cast<float>(max));
    EXPECT_FLOAT_EQ(row_sum[i], static_cast<float>(std::exp(x[0] - max) + std::exp(x[1] - max)));
  }
}

}  // namespace
}  // namespace tokamax
