// layer_norm's kernels on every tier and dtype against the float64 oracle, every config of the
// space, the backward's fixed-order dscale/doffset and config errors.
#include "csrc/ops/layer_norm/layer_norm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/base/test_util.h"
#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/runtime/parallel.h"

namespace tokamax {
namespace {

using testing::Buffer;

constexpr int64_t kRows = 37, kCols = 203, kRowStride = 211;  // odd sizes, rows kRowStride apart

LayerNormRows RowsView(const Buffer& b) {
  LayerNormRows v;
  v.data = b.data();
  v.dtype = b.dtype;
  v.sizes[0] = kRows;
  v.sizes[1] = kCols;
  v.strides[0] = kRowStride;
  v.strides[1] = 1;
  return v;
}

// The forward's params over kRows rows of x (kRowStride apart) with an fp32 scale of kCols.
LayerNormParams RowParams(const Buffer& x, const Buffer& scale, Buffer& y, std::vector<float>& mean,
                          std::vector<float>& rstd) {
  LayerNormParams p;
  p.rows = kRows;
  p.cols = kCols;
  p.x = RowsView(x);
  p.scale.data = scale.data();
  p.scale.sizes[0] = kCols;
  p.scale.strides[0] = 1;
  p.y = y.data();
  p.mean = mean.data();
  p.rstd = rstd.data();
  return p;
}

class LayerNormTest : public ::testing::TestWithParam<std::tuple<Isa, DType, bool>> {};

TEST_P(LayerNormTest, ForwardMatchesFloat64OracleForEveryConfig) {
  const auto [isa, dtype, subtract_mean] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  testing::ScopedIsa scoped(isa);
  Buffer x(dtype, kRows * kRowStride, 1), y(dtype, kRows * kCols), scale(DType::kFloat32, kCols);
  testing::FillRandom(x, kRows * kRowStride, 1);
  testing::FillRandom(scale, kCols, 2);
  std::vector<double> xd(kRows * kCols), w(kCols), b;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kCols; ++c) xd[r * kCols + c] = x.Get(r * kRowStride + c);
  }
  for (int64_t c = 0; c < kCols; ++c) w[c] = scale.Get(c) + 1.0;
  std::vector<double> want_y, want_mean, want_rstd;
  LayerNormReference(xd, kRows, kCols, w, b, 1e-5, subtract_mean, &want_y, &want_mean, &want_rstd);
  const LayerNormShape shape{kRows, kCols};
  for (const LayerNormConfig& config : LayerNormConfigSpace(shape, dtype, GetCpuInfo(), LayerNormProduct::kForward)) {
    std::vector<float> mean(kRows), rstd(kRows);
    LayerNormParams p = RowParams(x, scale, y, mean, rstd);
    p.epsilon = 1e-5;
    p.scale_offset = 1.0;
    p.subtract_mean = subtract_mean;
    ASSERT_TRUE(LayerNorm(p, config).ok());
    double max_err = 0, max_ref = 0;
    for (int64_t i = 0; i < kRows * kCols; ++i) {
      max_err = std::max(max_err, std::fabs(y.Get(i) - want_y[i]));
      max_ref = std::max(max_ref, std::fabs(want_y[i]));
    }
    EXPECT_LE(max_err / max_ref, testing::Tolerance(dtype)) << IsaName(isa) << " block_rows " << config.block_rows;
    for (int64_t r = 0; r < kRows; ++r) {
      EXPECT_NEAR(rstd[r], want_rstd[r], 1e-5 * want_rstd[r]);
      EXPECT_NEAR(mean[r], want_mean[r], 1e-5);
    }
  }
}

// dscale and doffset: every config against the float64 sums, and the same bits serially and
// on two threads.
TEST_P(LayerNormTest, BackwardSumsAreFixedOrder) {
  const auto [isa, dtype, subtract_mean] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  testing::ScopedIsa scoped(isa);
  Buffer x(dtype, kRows * kRowStride), dy(dtype, kRows * kRowStride), dx(dtype, kRows * kCols);
  Buffer scale(DType::kFloat32, kCols), offset(DType::kFloat32, kCols);
  testing::FillRandom(x, kRows * kRowStride, 3);
  testing::FillRandom(dy, kRows * kRowStride, 4);
  testing::FillRandom(scale, kCols, 5);
  // Statistics from the forward.
  std::vector<float> mean(kRows), rstd(kRows);
  Buffer y(dtype, kRows * kCols);
  LayerNormParams p = RowParams(x, scale, y, mean, rstd);
  p.offset = p.scale;
  p.offset.data = offset.data();
  p.subtract_mean = subtract_mean;
  ASSERT_TRUE(LayerNorm(p, LayerNormConfig{}).ok());
  p.dy = RowsView(dy);
  p.y = dx.data();
  std::vector<double> want_ds(kCols, 0.0), want_db(kCols, 0.0);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      const double xhat = (double(x.Get(r * kRowStride + c)) - mean[r]) * rstd[r];
      want_ds[c] += dy.Get(r * kRowStride + c) * xhat;
      want_db[c] += dy.Get(r * kRowStride + c);
    }
  }
  // In one block the partials are the final sums: each column adds the rows in order, in fp32,
  // dy * xhat fused into the add (the scalar tier's a * b + c may be left unfused by the compiler).
  std::vector<float> ordered_ds(kCols, 0.0f), unfused_ds(kCols, 0.0f), ordered_db(kCols, 0.0f);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      const float d = static_cast<float>(dy.Get(r * kRowStride + c));
      const float xhat = (static_cast<float>(x.Get(r * kRowStride + c)) - mean[r]) * rstd[r];
      ordered_ds[c] = std::fma(d, xhat, ordered_ds[c]);
      const volatile float product = d * xhat;  // volatile: kept unfused
      unfused_ds[c] = product + unfused_ds[c];
      ordered_db[c] += d;
    }
  }
  const LayerNormShape shape{kRows, kCols};
  bool checked_order = false;
  for (const LayerNormConfig& config : LayerNormConfigSpace(shape, dtype, GetCpuInfo(), LayerNormProduct::kBackward)) {
    std::vector<float> ds[2], db[2];
    for (int run = 0; run < 2; ++run) {
      ds[run].assign(kCols, NAN);
      db[run].assign(kCols, NAN);
      p.dscale = ds[run].data();
      p.doffset = db[run].data();
      if (run == 1) SetParallelBackend(&testing::TwoThreadBackend);
      ASSERT_TRUE(LayerNormBackward(p, config).ok());
      SetParallelBackend(nullptr);
    }
    EXPECT_EQ(std::memcmp(ds[0].data(), ds[1].data(), kCols * 4), 0) << "block_rows " << config.block_rows;
    EXPECT_EQ(std::memcmp(db[0].data(), db[1].data(), kCols * 4), 0) << "block_rows " << config.block_rows;
    for (int64_t c = 0; c < kCols; ++c) {
      EXPECT_NEAR(ds[0][c], want_ds[c], 1e-4 * (1 + std::fabs(want_ds[c])));
      EXPECT_NEAR(db[0][c], want_db[c], 1e-4 * (1 + std::fabs(want_db[c])));
    }
    if (config.block_rows >= kRows && dtype != DType::kFloat64) {
      checked_order = true;
      for (int64_t c = 0; c < kCols; ++c) {
        const bool fused = std::memcmp(&ds[0][c], &ordered_ds[c], 4) == 0;
        const bool unfused = isa == Isa::kScalar && std::memcmp(&ds[0][c], &unfused_ds[c], 4) == 0;
        EXPECT_TRUE(fused || unfused) << "dscale column " << c << ": rows not added in order";
      }
      EXPECT_EQ(std::memcmp(db[0].data(), ordered_db.data(), kCols * 4), 0) << "doffset: rows not added in order";
    }
  }
  if (dtype != DType::kFloat64) {
    EXPECT_TRUE(checked_order) << "no config puts all the rows in one block";
  }
}

std::string ParamName(const ::testing::TestParamInfo<std::tuple<Isa, DType, bool>>& info) {
  static const char* const kDTypes[] = {"fp32", "bf16", "fp16", "fp64"};
  return std::string(IsaName(std::get<0>(info.param))) + "_" + kDTypes[static_cast<int>(std::get<1>(info.param))] +
         (std::get<2>(info.param) ? "_layer" : "_rms");
}

INSTANTIATE_TEST_SUITE_P(AllTiers, LayerNormTest,
                         ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                                            ::testing::Bool()),
                         ParamName);

TEST(LayerNormConfigTest, SpaceStartsWithTheHeuristicAndIsValid) {
  const LayerNormShape shape{8192, 4096};
  const auto space = LayerNormConfigSpace(shape, DType::kFloat32, GetCpuInfo(), LayerNormProduct::kBackward);
  ASSERT_GT(space.size(), 1u);
  EXPECT_EQ(space[0], LayerNormHeuristicConfig(shape, DType::kFloat32, GetCpuInfo(), LayerNormProduct::kBackward));
  for (const auto& config : space) EXPECT_TRUE(config.Validate().ok());
  LayerNormConfig bad;
  bad.block_rows = 0;
  LayerNormParams p;
  EXPECT_NE(LayerNorm(p, bad).message().find("layer_norm config: block_rows must be"), std::string::npos);
}

}  // namespace
}  // namespace tokamax
