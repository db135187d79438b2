// GemmPrologue's A-row gather (gemm.h) on every tier and dtype: the product over rows of A read
// through a map (with repeats, row-major and transposed A, tails of every tile size) is bitwise
// the product over the gathered copy, with and without an epilogue that scatters C's rows, and
// matches the float64 oracle on that copy.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "csrc/core/base/test_util.h"
#include "csrc/core/gemm/gemm.h"
#include "csrc/core/runtime/cpu_info.h"

namespace tokamax {
namespace {

using testing::Buffer;

class GemmGatherTest : public ::testing::TestWithParam<std::tuple<Isa, DType, bool>> {};

TEST_P(GemmGatherTest, GatheredEqualsProductOnGatheredCopy) {
  const auto [isa, dtype, transposed_a] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  // 29 result rows (tails of the 6-, 12- and 16-row tiles) from a 41-row source, K = 37 (a tail
  // of the 8-step register transposes), N = 50.
  const int64_t m = 29, src_rows = 41, k = 37, n = 50;
  Buffer src(dtype, src_rows * k, 1), b(dtype, k * n, 3);
  testing::FillRandom(src, src_rows * k, 1);
  testing::FillRandom(b, k * n, 2);
  std::vector<int64_t> a_row_map(m);
  for (int64_t i = 0; i < m; ++i) a_row_map[i] = (i * 7 + 3) % 23;  // rows repeat past 23
  // A(r, p) at r * k + p, or with `transposed_a` at p * src_rows + r.
  const ConstMatrix am = transposed_a ? ConstMatrix{src.data(), dtype, m, k, 1, src_rows}
                                      : ConstMatrix{src.data(), dtype, m, k, k, 1};
  Buffer copy(dtype, m * k);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t p = 0; p < k; ++p) {
      const int64_t r = a_row_map[i];
      copy.Set(i * k + p, src.Get(transposed_a ? p * src_rows + r : r * k + p));
    }
  }
  const ConstMatrix copy_m{copy.data(), dtype, m, k, k, 1};
  const ConstMatrix bm{b.data(), dtype, k, n, n, 1};

  std::vector<float> bias(n);
  for (int64_t j = 0; j < n; ++j) bias[j] = 0.03f * static_cast<float>(j % 5) - 0.05f;
  std::vector<int64_t> c_row_map(m);
  for (int64_t i = 0; i < m; ++i) c_row_map[i] = (i * 11) % m;  // 11 and 29 coprime: a permutation
  GemmEpilogue scatter;
  scatter.scale = 0.5f;
  scatter.bias = bias.data();
  scatter.activation = Activation::kSilu;
  scatter.row_map = c_row_map.data();
  GemmPrologue gather;
  gather.a_row_map = a_row_map.data();

  const GemmKernels& kernels = GetGemmKernels(isa);
  for (const GemmBlocking& blocking : {GemmBlocking{12, 16, 16, true}, GemmBlocking{12, 16, 16, false},
                                       GemmBlocking{}}) {
    for (const GemmEpilogue& epilogue : {GemmEpilogue{}, scatter}) {
      Buffer got(dtype, m * n), want(dtype, m * n);
      testing::Poison(got, m * n);
      testing::Poison(want, m * n);
      GemmRegion(kernels, am, bm, {got.data(), dtype, m, n, n, 1}, 0, m, 0, n, blocking, epilogue, gather);
      GemmRegion(kernels, copy_m, bm, {want.data(), dtype, m, n, n, 1}, 0, m, 0, n, blocking, epilogue);
      const bool scattered = epilogue.row_map != nullptr;
      ASSERT_EQ(std::memcmp(got.data(), want.data(), m * n * DTypeSize(dtype)), 0)
          << "block_m=" << blocking.block_m << " pack_b=" << blocking.pack_b << " scatter=" << scattered;
      if (scattered) continue;
      // The oracle: float64 on the gathered copy, rounded to the dtype.
      std::vector<double> product(m * n);
      ReferenceGemm(copy_m, bm, {product.data(), DType::kFloat64, m, n, n, 1});
      Buffer oracle(dtype, m * n);
      for (int64_t i = 0; i < m * n; ++i) oracle.Set(i, static_cast<float>(product[i]));
      EXPECT_LE(testing::RelativeError(got, oracle, m * n), testing::Tolerance(dtype))
          << "block_m=" << blocking.block_m << " pack_b=" << blocking.pack_b;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllTiers, GemmGatherTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Bool()),
    [](const auto& info) {
      return std::string(IsaName(std::get<0>(info.param))) + "_" + DTypeName(std::get<1>(info.param)) +
             (std::get<2>(info.param) ? "_transposed_a" : "_row_major_a");
    });

// A region of rows m0..m1 reads the map from row m0 on, like the packed path.
TEST(GemmGatherTest, SubRegionReadsItsOwnMapEntries) {
  for (const Isa isa : {Isa::kScalar, Isa::kAvx512, Isa::kAmx}) {
    if (!IsaSupported(isa, GetCpuInfo())) continue;
    for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const int64_t m = 40, src_rows = 9, k = 64, n = 33;
      Buffer src(dtype, src_rows * k), b(dtype, k * n);
      testing::FillRandom(src, src_rows * k, 4);
      testing::FillRandom(b, k * n, 5);
      std::vector<int64_t> map(m);
      for (int64_t i = 0; i < m; ++i) map[i] = src_rows - 1 - i % src_rows;
      Buffer got(dtype, m * n), want(dtype, m * n);
      testing::Poison(got, m * n);
      testing::Poison(want, m * n);
      GemmPrologue gather;
      gather.a_row_map = map.data();
      const GemmKernels& kernels = GetGemmKernels(isa);
      const ConstMatrix am{src.data(), dtype, m, k, k, 1}, bm{b.data(), dtype, k, n, n, 1};
      const MutableMatrix gm{got.data(), dtype, m, n, n, 1};
      // Two row regions and two column regions, as ragged_dot's tasks split a group.
      for (const auto& [m0, m1] : {std::pair<int64_t, int64_t>{0, 17}, {17, m}}) {
        GemmRegion(kernels, am, bm, gm, m0, m1, 0, 20, GemmBlocking{}, {}, gather);
        GemmRegion(kernels, am, bm, gm, m0, m1, 20, n, GemmBlocking{}, {}, gather);
      }
      Buffer copy(dtype, m * k);
      for (int64_t i = 0; i < m * k; ++i) copy.Set(i, src.Get(map[i / k] * k + i % k));
      GemmRegion(kernels, {copy.data(), dtype, m, k, k, 1}, bm, {want.data(), dtype, m, n, n, 1}, 0, m, 0, n,
                 GemmBlocking{});
      EXPECT_EQ(std::memcmp(got.data(), want.data(), m * n * DTypeSize(dtype)), 0)
          << IsaName(isa) << " " << DTypeName(dtype);
    }
  }
}

// The float64 path reads A's rows through the map too.
TEST(GemmGatherTest, Float64Gather) {
  const int64_t m = 3, k = 2, n = 2;
  const double a[2 * k] = {1, 2, -3, 0.5};
  const double b[k * n] = {1, -1, 2, 0.25};
  const int64_t map[m] = {1, 0, 1};
  double c[m * n] = {};
  GemmPrologue gather;
  gather.a_row_map = map;
  GemmRegion(GetGemmKernels(Isa::kScalar), {a, DType::kFloat64, m, k, k, 1}, {b, DType::kFloat64, k, n, n, 1},
             {c, DType::kFloat64, m, n, n, 1}, 0, m, 0, n, GemmBlocking{}, {}, gather);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      EXPECT_EQ(c[i * n + j], a[map[i] * k] * b[j] + a[map[i] * k + 1] * b[n + j]) << i << " " << j;
    }
  }
}

}  // namespace
}  // namespace tokamax
