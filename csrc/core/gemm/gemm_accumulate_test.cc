// GemmEpilogue::accumulate (gemm.h): C += A·B into a non-zero C on every tier, every A/B dtype
// and C dtype, transposed operands, a row scatter, and a region written by two calls over several
// row, depth and column blocks: bitwise C + P, P the fp32 product GemmRegion writes without it.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/base/test_util.h"
#include "csrc/core/gemm/gemm.h"
#include "csrc/core/runtime/cpu_info.h"

namespace tokamax {
namespace {

using testing::Buffer;

class GemmAccumulateTest : public ::testing::TestWithParam<std::tuple<Isa, DType, DType>> {};

TEST_P(GemmAccumulateTest, AddsToNonZeroCBitwiseCPlusTheProduct) {
  const auto [isa, dtype, c_dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const GemmKernels& kernels = GetGemmKernels(isa);
  for (const bool transposed : {false, true}) {
    const int64_t m = 41, k = 70, n = 53, split = 20;
    Buffer a(dtype, m * k, 1), b(dtype, k * n, 3);
    testing::FillRandom(a, m * k, 1);
    testing::FillRandom(b, k * n, 2);
    const ConstMatrix am = transposed ? ConstMatrix{a.data(), dtype, m, k, 1, m} : ConstMatrix{a.data(), dtype, m, k, k, 1};
    const ConstMatrix bm = transposed ? ConstMatrix{b.data(), dtype, k, n, 1, k} : ConstMatrix{b.data(), dtype, k, n, n, 1};
    std::vector<int64_t> row_map(m);
    for (int64_t i = 0; i < m; ++i) row_map[i] = (i * 7) % m;  // 7 and 41 coprime: a permutation
    const GemmBlocking blocking{12, 16, 32, true};  // several row, depth and column blocks

    // P: the plain product into fp32 (the same tile buffer bits as any C dtype's store).
    std::vector<float> product(m * n);
    GemmRegion(kernels, am, bm, MutableMatrix{product.data(), DType::kFloat32, m, n, n, 1}, 0, m, 0, n, blocking);

    Buffer c(c_dtype, m * n), before(c_dtype, m * n);
    testing::FillRandom(c, m * n, 5);
    for (int64_t i = 0; i < m * n; ++i) before.Set(i, c.Get(i));
    GemmEpilogue epilogue;
    epilogue.accumulate = true;
    epilogue.row_map = row_map.data();
    const MutableMatrix cm{c.data(), c_dtype, m, n, n, 1};
    GemmRegion(kernels, am, bm, cm, 0, m, 0, split, blocking, epilogue);
    GemmRegion(kernels, am, bm, cm, 0, m, split, n, blocking, epilogue);

    Buffer want(c_dtype, m * n);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = row_map[i] * n + j;
        want.Set(at, before.Get(at) + product[i * n + j]);  // one fp32 add, one rounding into C's dtype
      }
    }
    EXPECT_EQ(std::memcmp(c.data(), want.data(), m * n * DTypeSize(c_dtype)), 0) << "transposed=" << transposed;
    // And it is the product: C + A·B against the float64 oracle.
    std::vector<double> exact(m * n);
    ReferenceGemm(am, bm, {exact.data(), DType::kFloat64, m, n, n, 1});
    Buffer oracle(c_dtype, m * n);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = row_map[i] * n + j;
        oracle.Set(at, static_cast<float>(before.Get(at) + exact[i * n + j]));
      }
    }
    EXPECT_LE(testing::RelativeError(c, oracle, m * n), testing::Tolerance(c_dtype));
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllTiers, GemmAccumulateTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16)),
    [](const auto& info) {
      return std::string(IsaName(std::get<0>(info.param))) + "_" + DTypeName(std::get<1>(info.param)) + "_into_" +
             DTypeName(std::get<2>(info.param));
    });

// Zero depth leaves C as it was; the float64 path adds in double.
TEST(GemmAccumulateFloat64Test, ZeroDepthKeepsCAndDoubleAdds) {
  GemmEpilogue e;
  e.accumulate = true;
  float c32[4] = {1.5f, -2.0f, 3.25f, 0.125f};
  const float none[1] = {0.0f};
  GemmRegion(GetGemmKernels(Isa::kScalar), {none, DType::kFloat32, 2, 0, 1, 1}, {none, DType::kFloat32, 0, 2, 2, 1},
             {c32, DType::kFloat32, 2, 2, 2, 1}, 0, 2, 0, 2, GemmBlocking{}, e);
  EXPECT_EQ(c32[0], 1.5f);
  EXPECT_EQ(c32[3], 0.125f);
  const double a[2 * 3] = {1, 2, 3, -1, 0.5, 4};
  const double b[3 * 2] = {1e-9, 2, -3, 1, 0.25, 1};
  double c[2 * 2] = {1.0, -1.0, 1e9, 0.5};
  const double was[4] = {c[0], c[1], c[2], c[3]};
  GemmRegion(GetGemmKernels(Isa::kScalar), {a, DType::kFloat64, 2, 3, 3, 1}, {b, DType::kFloat64, 3, 2, 2, 1},
             {c, DType::kFloat64, 2, 2, 2, 1}, 0, 2, 0, 2, GemmBlocking{}, e);
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 2; ++j) {
      double dot = 0.0;
      for (int64_t p = 0; p < 3; ++p) dot += a[i * 3 + p] * b[p * 2 + j];
      EXPECT_EQ(c[i * 2 + j], dot + was[i * 2 + j]) << i << " " << j;
    }
  }
}

}  // namespace
}  // namespace tokamax
