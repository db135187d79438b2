// linear_softmax_cross_entropy_loss's kernels on every tier and dtype against a float64 oracle
// (loss, lse, dx, dW; both weight layouts), every config of the space, bits across a serial and
// a two-thread backend, label and config errors.
#include "csrc/ops/linear_softmax_cross_entropy_loss/linear_softmax_cross_entropy_loss.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/base/test_util.h"
#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/runtime/parallel.h"

namespace tokamax {
namespace {

using testing::Buffer;

// Odd sizes: a partial last vocab tile, partial column groups and H chunks.
constexpr int64_t kB = 37, kH = 29, kV = 150, kIgnored = 5;
constexpr double kSmoothing = 0.1, kZLoss = 0.01;

struct Problem {
  DType dtype;
  bool linear_layout;  // W stored [V, H] (an nn.Linear weight) and read as its transposed view
  Buffer x, w, dx, dw;
  std::vector<int64_t> labels;
  std::vector<float> loss, lse, dloss;

  Problem(DType dt, bool linear)
      : dtype(dt), linear_layout(linear), x(dt, kB * kH, 1), w(dt, kH * kV, 1), dx(dt, kB * kH), dw(dt, kH * kV),
        labels(kB), loss(kB), lse(kB), dloss(kB) {
    testing::FillRandom(x, kB * kH, 1);
    testing::FillRandom(w, kH * kV, 2);
    for (int64_t r = 0; r < kB; ++r) {
      labels[r] = (r * 37 + 11) % kV;
      dloss[r] = 0.5f + 0.03f * static_cast<float>(r);  // a non-uniform upstream gradient
    }
    labels[kIgnored] = -100;
  }
  double X(int64_t r, int64_t h) const { return x.Get(r * kH + h); }
  int64_t WOffset(int64_t h, int64_t v) const { return linear_layout ? v * kH + h : h * kV + v; }
  double W(int64_t h, int64_t v) const { return w.Get(WOffset(h, v)); }

  LinearCrossEntropyParams Params(double cap) {
    LinearCrossEntropyParams p;
    p.x = {x.data(), dtype, {kB, kH}, {kH, 1}};
    p.w = {w.data(), dtype, {kH, kV}, {linear_layout ? 1 : kV, linear_layout ? kH : 1}};
    p.labels = labels.data();
    p.reduction = LossReduction::kNone;
    p.label_smoothing = kSmoothing;
    p.z_loss_weight = kZLoss;
    p.logits_soft_cap = cap;
    p.loss = loss.data();
    p.lse = lse.data();
    p.dloss = dloss.data();
    p.dx = {dx.data(), dtype, {kB, kH}, {kH, 1}};
    p.dw = {dw.data(), dtype, {kH, kV}, {linear_layout ? 1 : kV, linear_layout ? kH : 1}};
    return p;
  }
};

// The float64 oracle: per-row loss and lse, and dx, dW for the upstream gradient dloss.
struct Oracle {
  std::vector<double> loss, lse, dx, dw;
};

Oracle Reference(const Problem& pr, double cap) {
  Oracle o{std::vector<double>(kB), std::vector<double>(kB), std::vector<double>(kB * kH, 0.0),
           std::vector<double>(kH * kV, 0.0)};
  std::vector<double> z(kV), d(kV);
  for (int64_t r = 0; r < kB; ++r) {
    double max = -std::numeric_limits<double>::infinity(), zsum = 0.0;
    for (int64_t v = 0; v < kV; ++v) {
      double s = 0.0;
      for (int64_t h = 0; h < kH; ++h) s += pr.X(r, h) * pr.W(h, v);
      z[v] = cap > 0 ? cap * std::tanh(s / cap) : s;
      max = std::max(max, z[v]);
      zsum += z[v];
    }
    double sum = 0.0;
    for (int64_t v = 0; v < kV; ++v) sum += std::exp(z[v] - max);
    const double lse = max + std::log(sum);
    o.lse[r] = lse;
    const bool ignored = pr.labels[r] == -100;
    const int64_t y = pr.labels[r];
    o.loss[r] = ignored ? 0.0
                        : (1 - kSmoothing) * (lse - z[y]) + kSmoothing * (lse - zsum / kV) + kZLoss * lse * lse;
    const double g = ignored ? 0.0 : pr.dloss[r];
    for (int64_t v = 0; v < kV; ++v) {
      const double p = std::exp(z[v] - lse);
      double dz = g * ((1 + 2 * kZLoss * lse) * p - kSmoothing / kV - (v == y ? 1 - kSmoothing : 0.0));
      if (cap > 0) dz *= 1 - (z[v] / cap) * (z[v] / cap);
      d[v] = dz;
    }
    for (int64_t h = 0; h < kH; ++h) {
      for (int64_t v = 0; v < kV; ++v) {
        o.dx[r * kH + h] += d[v] * pr.W(h, v);
        o.dw[h * kV + v] += pr.X(r, h) * d[v];
      }
    }
  }
  return o;
}

double MaxRelative(const std::vector<double>& want, const std::function<double(int64_t)>& got) {
  double diff = 0.0, scale = 1e-6;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got(static_cast<int64_t>(i));
    if (std::isnan(g)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::fabs(g - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return diff / scale;
}

double GradTolerance(DType dtype) {
  // bf16 rounds the dlogits tile to bf16 before the two gradient products.
  return dtype == DType::kFloat32 ? 1e-5 : (dtype == DType::kBFloat16 ? 2e-2 : 2e-3);
}

// The plain forward: gradient buffers set on the forward ask for the fold (tested in Python).
LinearCrossEntropyParams ForwardOnly(LinearCrossEntropyParams p) {
  p.dx = {};
  p.dw = {};
  return p;
}

class LinearCrossEntropyTest : public ::testing::TestWithParam<std::tuple<Isa, DType, bool>> {};

TEST_P(LinearCrossEntropyTest, MatchesFloat64OracleForEveryConfig) {
  const auto [isa, dtype, linear_layout] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  testing::ScopedIsa scoped(isa);
  const LinearCrossEntropyShape shape{kB, kH, kV};
  for (double cap : {0.0, 2.0}) {
    Problem pr(dtype, linear_layout);
    const Oracle want = Reference(pr, cap);
    for (const LinearCrossEntropyConfig& config :
         LinearCrossEntropyConfigSpace(shape, dtype, GetCpuInfo(), LinearCrossEntropyProduct::kForward)) {
      const std::string where = std::string(IsaName(isa)) + " cap " + std::to_string(cap) + " config " +
                                std::to_string(config.row_block) + "/" + std::to_string(config.vocab_block) + "/" +
                                std::to_string(config.block_k);
      LinearCrossEntropyParams p = pr.Params(cap);
      ASSERT_TRUE(LinearCrossEntropy(ForwardOnly(p), config).ok()) << where;
      EXPECT_LT(MaxRelative(want.loss, [&](int64_t i) { return pr.loss[i]; }), 2e-5) << where;
      EXPECT_LT(MaxRelative(want.lse, [&](int64_t i) { return pr.lse[i]; }), 2e-6) << where;
      testing::Poison(pr.dx, kB * kH);
      testing::Poison(pr.dw, kH * kV);
      ASSERT_TRUE(LinearCrossEntropyBackward(p, config).ok()) << where;
      EXPECT_LT(MaxRelative(want.dx, [&](int64_t i) { return pr.dx.Get(i); }), GradTolerance(dtype)) << where;
      EXPECT_LT(MaxRelative(want.dw, [&](int64_t i) { return pr.dw.Get(pr.WOffset(i / kV, i % kV)); }),
                GradTolerance(dtype))
          << where;
    }
  }
}

TEST_P(LinearCrossEntropyTest, TwoThreadsGiveTheSerialBits) {
  const auto [isa, dtype, linear_layout] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  testing::ScopedIsa scoped(isa);
  LinearCrossEntropyConfig config;
  config.row_block = 16;
  config.vocab_block = 64;
  std::vector<uint8_t> bits[2];
  for (int run = 0; run < 2; ++run) {
    if (run == 1) SetParallelBackend(&testing::TwoThreadBackend);
    Problem pr(dtype, linear_layout);
    LinearCrossEntropyParams p = pr.Params(0.0);
    ASSERT_TRUE(LinearCrossEntropy(ForwardOnly(p), config).ok());
    ASSERT_TRUE(LinearCrossEntropyBackward(p, config).ok());
    SetParallelBackend(nullptr);
    for (const void* data : {static_cast<const void*>(pr.loss.data()), static_cast<const void*>(pr.lse.data())}) {
      bits[run].insert(bits[run].end(), static_cast<const uint8_t*>(data),
                       static_cast<const uint8_t*>(data) + kB * sizeof(float));
    }
    for (const testing::Buffer* grad : {&pr.dx, &pr.dw}) {
      const uint8_t* first = static_cast<const uint8_t*>(grad->data());
      bits[run].insert(bits[run].end(), first, first + grad->count * DTypeSize(grad->dtype));
    }
  }
  EXPECT_EQ(bits[0], bits[1]);
}

std::string ParamName(const ::testing::TestParamInfo<std::tuple<Isa, DType, bool>>& info) {
  static const char* const kDTypes[] = {"fp32", "bf16", "fp16", "fp64"};
  return std::string(IsaName(std::get<0>(info.param))) + "_" + kDTypes[static_cast<int>(std::get<1>(info.param))] +
         (std::get<2>(info.param) ? "_linear_layout" : "_hv");
}

INSTANTIATE_TEST_SUITE_P(AllTiers, LinearCrossEntropyTest,
                         ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16,
                                                              Isa::kAmx),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                                            ::testing::Bool()),
                         ParamName);

TEST(LinearCrossEntropyErrors, LabelsOutOfRangeAreRejectedBeforeAnyWrite) {
  Problem pr(DType::kFloat32, false);
  pr.labels[3] = kV;
  std::fill(pr.lse.begin(), pr.lse.end(), 7.0f);
  LinearCrossEntropyParams p = pr.Params(0.0);
  const Status status = LinearCrossEntropy(ForwardOnly(p), LinearCrossEntropyConfig{});
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("labels must be in [0, 150)"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("got 150 at row 3"), std::string::npos) << status.message();
  EXPECT_EQ(pr.lse[0], 7.0f);
}

TEST(LinearCrossEntropyConfigTest, SpaceStartsWithTheHeuristicAndIsValid) {
  for (const LinearCrossEntropyShape shape : {LinearCrossEntropyShape{4096, 2048, 32000},
                                              LinearCrossEntropyShape{2048, 1024, 128256},
                                              LinearCrossEntropyShape{1, 1, 1}}) {
    const auto space = LinearCrossEntropyConfigSpace(shape, DType::kBFloat16, GetCpuInfo(),
                                                     LinearCrossEntropyProduct::kBackward);
    ASSERT_GT(space.size(), 1u);
    EXPECT_EQ(space[0], LinearCrossEntropyHeuristicConfig(shape, DType::kBFloat16, GetCpuInfo(),
                                                          LinearCrossEntropyProduct::kBackward));
    for (const auto& config : space) EXPECT_TRUE(config.Validate().ok());
  }
  LinearCrossEntropyConfig too_big;
  too_big.row_block = 8192;
  too_big.vocab_block = 16384;
  EXPECT_NE(too_big.Validate().message().find("row_block * vocab_block * 4"), std::string::npos);
}

}  // namespace
}  // namespace tokamax
