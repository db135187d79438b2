// fused_experts / fused_moe core: the forward against a float64 loop (fp32 and float64, Hugging
// Face's transposed weight views and contiguous ones, both activations, biases), the backward
// against central differences of the forward in float64 (every input at once, along a random
// direction), the router's ties and renormalisation, id errors before any write, configs.
#include "csrc/ops/fused_moe/fused_moe.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace tokamax {
namespace {

struct Sizes {
  int64_t t = 9, h = 13, inter = 7, e = 4, k = 2;
};

// Owned float64 operands; w1/w2 stored as Hugging Face does (gate_up[E, 2I, H], down[E, H, I])
// when `hf`, else as [E, H, 2I] and [E, I, H].
struct Operands {
  Sizes s;
  bool hf = true;
  std::vector<double> x, w1, w2, b1, b2, tw;
  std::vector<int64_t> ids;

  Operands(Sizes sizes, bool hf_layout, uint32_t seed) : s(sizes), hf(hf_layout) {
    std::mt19937 gen(seed);
    std::normal_distribution<double> normal;
    auto fill = [&](std::vector<double>& v, int64_t n, double scale) {
      v.resize(n);
      for (double& d : v) d = normal(gen) * scale;
    };
    fill(x, s.t * s.h, 1.0);
    fill(w1, s.e * s.h * 2 * s.inter, 0.3);
    fill(w2, s.e * s.inter * s.h, 0.3);
    fill(b1, s.e * 2 * s.inter, 0.1);
    fill(b2, s.e * s.h, 0.1);
    fill(tw, s.t * s.k, 0.5);
    for (int64_t t = 0; t < s.t; ++t) {
      for (int64_t j = 0; j < s.k; ++j) ids.push_back((t + j) % (s.e - 1));  // expert e-1 gets no rows
    }
  }
  // w1[e][h][c] and w2[e][i][h] as the kernel's strided views see them.
  StridedView<3> W1View(const void* data, DType dtype) const {
    if (hf) return {data, dtype, {s.e, s.h, 2 * s.inter}, {2 * s.inter * s.h, 1, s.h}};
    return {data, dtype, {s.e, s.h, 2 * s.inter}, {s.h * 2 * s.inter, 2 * s.inter, 1}};
  }
  StridedView<3> W2View(const void* data, DType dtype) const {
    if (hf) return {data, dtype, {s.e, s.inter, s.h}, {s.h * s.inter, 1, s.inter}};
    return {data, dtype, {s.e, s.inter, s.h}, {s.inter * s.h, s.h, 1}};
  }
  double W1(int64_t e, int64_t h, int64_t c) const { return w1[W1View(nullptr, DType::kFloat64).Offset(e, h, c)]; }
  double W2(int64_t e, int64_t i, int64_t h) const { return w2[W2View(nullptr, DType::kFloat64).Offset(e, i, h)]; }
};

double Act(Activation a, double g) { return Activate(a, g); }

// The same view, writable (a gradient laid out as its weight).
MutableStridedView<3> Writable(const StridedView<3>& view, void* data) {
  MutableStridedView<3> out;
  out.data = data;
  out.dtype = view.dtype;
  for (int d = 0; d < 3; ++d) {
    out.sizes[d] = view.sizes[d];
    out.strides[d] = view.strides[d];
  }
  return out;
}

std::vector<double> ReferenceForward(const Operands& o, Activation act, bool bias) {
  const Sizes& s = o.s;
  std::vector<double> out(s.t * s.h, 0.0);
  for (int64_t t = 0; t < s.t; ++t) {
    for (int64_t j = 0; j < s.k; ++j) {
      const int64_t e = o.ids[t * s.k + j];
      std::vector<double> h(s.inter);
      for (int64_t i = 0; i < s.inter; ++i) {
        double g = bias ? o.b1[e * 2 * s.inter + i] : 0, u = bias ? o.b1[e * 2 * s.inter + s.inter + i] : 0;
        for (int64_t c = 0; c < s.h; ++c) {
          g += o.x[t * s.h + c] * o.W1(e, c, i);
          u += o.x[t * s.h + c] * o.W1(e, c, s.inter + i);
        }
        h[i] = Act(act, g) * u;
      }
      for (int64_t c = 0; c < s.h; ++c) {
        double y = bias ? o.b2[e * s.h + c] : 0;
        for (int64_t i = 0; i < s.inter; ++i) y += h[i] * o.W2(e, i, c);
        out[t * s.h + c] += o.tw[t * s.k + j] * y;
      }
    }
  }
  return out;
}

FusedExpertsParams Params(const Operands& o, Activation act, bool bias, DType dtype, const void* x, const void* w1,
                          const void* w2, const void* b1, const void* b2, const void* tw) {
  const Sizes& s = o.s;
  FusedExpertsParams p;
  p.activation = act;
  p.x = {x, dtype, {s.t, s.h}, {s.h, 1}};
  p.w1 = o.W1View(w1, dtype);
  p.w2 = o.W2View(w2, dtype);
  if (bias) {
    p.w1_bias = {b1, dtype, {s.e, 2 * s.inter}, {2 * s.inter, 1}};
    p.w2_bias = {b2, dtype, {s.e, s.h}, {s.h, 1}};
  }
  p.topk_weights = {tw, dtype, {s.t, s.k}, {s.k, 1}};
  p.topk_ids = {o.ids.data(), true, s.t, s.k, s.k, 1};
  return p;
}

std::vector<double> RunForward(const Operands& o, Activation act, bool bias, const FusedExpertsConfig& config) {
  std::vector<double> out(o.s.t * o.s.h, -1.0);
  FusedExpertsParams p = Params(o, act, bias, DType::kFloat64, o.x.data(), o.w1.data(), o.w2.data(), o.b1.data(),
                                o.b2.data(), o.tw.data());
  p.out = {out.data(), DType::kFloat64, {o.s.t, o.s.h}, {o.s.h, 1}};
  EXPECT_TRUE(FusedExperts(p, config).ok());
  return out;
}

class FusedExpertsTest : public ::testing::TestWithParam<std::tuple<bool, Activation, bool>> {};

TEST_P(FusedExpertsTest, ForwardMatchesFloat64LoopInFloat64AndFloat32) {
  const auto [hf, act, bias] = GetParam();
  const Operands o(Sizes{}, hf, 1);
  const std::vector<double> want = ReferenceForward(o, act, bias);
  const std::vector<double> got = RunForward(o, act, bias, FusedExpertsConfig{});
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-10) << i;

  auto narrow = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  const std::vector<float> x = narrow(o.x), w1 = narrow(o.w1), w2 = narrow(o.w2), b1 = narrow(o.b1),
                           b2 = narrow(o.b2), tw = narrow(o.tw);
  std::vector<float> out(want.size());
  FusedExpertsParams p = Params(o, act, bias, DType::kFloat32, x.data(), w1.data(), w2.data(), b1.data(), b2.data(),
                                tw.data());
  p.out = {out.data(), DType::kFloat32, {o.s.t, o.s.h}, {o.s.h, 1}};
  FusedExpertsConfig config;
  config.task_rows = 6;  // several tasks per expert
  config.block_k = 16;   // several K slices
  ASSERT_TRUE(FusedExperts(p, config).ok());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(out[i], want[i], 2e-5 * (1 + std::abs(want[i]))) << i;
}

// <dout, d/dθ F · v> from the backward against (F(θ + εv) - F(θ - εv)) / 2ε, θ every input.
TEST_P(FusedExpertsTest, BackwardMatchesCentralDifferencesInFloat64) {
  const auto [hf, act, bias] = GetParam();
  const Operands o(Sizes{}, hf, 2);
  const Operands v(Sizes{}, hf, 3);  // the direction (same ids)
  std::vector<double> dout(o.s.t * o.s.h);
  std::mt19937 gen(4);
  std::normal_distribution<double> normal;
  for (double& d : dout) d = normal(gen);

  std::vector<double> dx(o.x.size()), dw1(o.w1.size()), dw2(o.w2.size()), db1(o.b1.size()), db2(o.b2.size()),
      dtw(o.tw.size());
  FusedExpertsParams p = Params(o, act, bias, DType::kFloat64, o.x.data(), o.w1.data(), o.w2.data(), o.b1.data(),
                                o.b2.data(), o.tw.data());
  const Sizes& s = o.s;
  p.dout = {dout.data(), DType::kFloat64, {s.t, s.h}, {s.h, 1}};
  p.dx = {dx.data(), DType::kFloat64, {s.t, s.h}, {s.h, 1}};
  p.dw1 = Writable(o.W1View(nullptr, DType::kFloat64), dw1.data());
  p.dw2 = Writable(o.W2View(nullptr, DType::kFloat64), dw2.data());
  if (bias) {
    p.dw1_bias = {db1.data(), DType::kFloat64, {s.e, 2 * s.inter}, {2 * s.inter, 1}};
    p.dw2_bias = {db2.data(), DType::kFloat64, {s.e, s.h}, {s.h, 1}};
  }
  p.dtopk_weights = {dtw.data(), DType::kFloat64, {s.t, s.k}, {s.k, 1}};
  FusedExpertsConfig config;
  config.task_rows = 6;
  ASSERT_TRUE(FusedExpertsBackward(p, config).ok());

  auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
    double sum = 0;
    for (size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
    return sum;
  };
  double analytic = dot(dx, v.x) + dot(dw1, v.w1) + dot(dw2, v.w2) + dot(dtw, v.tw);
  if (bias) analytic += dot(db1, v.b1) + dot(db2, v.b2);
  const double eps = 1e-5;
  auto shifted = [&](double sign) {
    Operands q = o;
    for (auto [dst, dir] : {std::pair{&q.x, &v.x}, {&q.w1, &v.w1}, {&q.w2, &v.w2}, {&q.b1, &v.b1}, {&q.b2, &v.b2},
                            {&q.tw, &v.tw}}) {
      for (size_t i = 0; i < dst->size(); ++i) (*dst)[i] += sign * eps * (*dir)[i];
    }
    return dot(RunForward(q, act, bias, config), dout);
  };
  const double numeric = (shifted(1) - shifted(-1)) / (2 * eps);
  EXPECT_NEAR(analytic, numeric, 1e-6 * (1 + std::abs(numeric)));
  // Expert e-1 gets no rows: exact-zero weight gradients.
  std::vector<int64_t> rows(s.e, 0);
  for (int64_t id : o.ids) ++rows[id];
  ASSERT_EQ(rows[s.e - 1], 0);
  for (int64_t e = 0; e < s.e; ++e) {
    if (rows[e] != 0) continue;
    for (int64_t i = 0; i < s.h * 2 * s.inter; ++i) EXPECT_EQ(dw1[e * s.h * 2 * s.inter + i], 0.0);
    for (int64_t i = 0; i < s.inter * s.h; ++i) EXPECT_EQ(dw2[e * s.inter * s.h + i], 0.0);
    if (bias) {
      for (int64_t i = 0; i < s.h; ++i) EXPECT_EQ(db2[e * s.h + i], 0.0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, FusedExpertsTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(Activation::kSilu, Activation::kGeluTanh),
                                            ::testing::Bool()));

// The pre-activations a forward saves give the backward the bits it gets by recomputing them.
TEST(FusedExperts, SavedResidualsGiveTheRecomputedBackwardBitwise) {
  const Operands o(Sizes{}, true, 6);
  const Sizes& s = o.s;
  auto narrow = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  const std::vector<float> x = narrow(o.x), w1 = narrow(o.w1), w2 = narrow(o.w2), b1 = narrow(o.b1),
                           b2 = narrow(o.b2), tw = narrow(o.tw);
  std::vector<float> out(s.t * s.h), dout(s.t * s.h), residuals(s.t * s.k * 2 * s.inter, -1.0f);
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = std::sin(0.1f * static_cast<float>(i));
  FusedExpertsConfig config;
  config.task_rows = 6;
  config.block_n = 16;  // several column tasks per expert
  auto backward = [&](void* saved) {
    std::vector<float> dx(x.size()), dw1(w1.size()), dw2(w2.size()), dtw(tw.size());
    FusedExpertsParams p = Params(o, Activation::kSilu, true, DType::kFloat32, x.data(), w1.data(), w2.data(),
                                  b1.data(), b2.data(), tw.data());
    p.dout = {dout.data(), DType::kFloat32, {s.t, s.h}, {s.h, 1}};
    p.dx = {dx.data(), DType::kFloat32, {s.t, s.h}, {s.h, 1}};
    p.dw1 = Writable(o.W1View(nullptr, DType::kFloat32), dw1.data());
    p.dw2 = Writable(o.W2View(nullptr, DType::kFloat32), dw2.data());
    p.dtopk_weights = {dtw.data(), DType::kFloat32, {s.t, s.k}, {s.k, 1}};
    p.residuals = saved;
    EXPECT_TRUE(FusedExpertsBackward(p, config).ok());
    std::vector<float> all = dx;
    for (const auto* v : {&dw1, &dw2, &dtw}) all.insert(all.end(), v->begin(), v->end());
    return all;
  };
  FusedExpertsParams p = Params(o, Activation::kSilu, true, DType::kFloat32, x.data(), w1.data(), w2.data(),
                                b1.data(), b2.data(), tw.data());
  p.out = {out.data(), DType::kFloat32, {s.t, s.h}, {s.h, 1}};
  p.residuals = residuals.data();
  ASSERT_TRUE(FusedExperts(p, config).ok());
  for (float r : residuals) ASSERT_NE(r, -1.0f);  // every pre-activation written
  const std::vector<float> saved = backward(residuals.data()), recomputed = backward(nullptr);
  ASSERT_EQ(saved.size(), recomputed.size());
  for (size_t i = 0; i < saved.size(); ++i) EXPECT_EQ(saved[i], recomputed[i]) << i;
}

TEST(FusedExperts, OutOfRangeIdFailsBeforeAnyWrite) {
  Operands o(Sizes{}, true, 5);
  o.ids[3] = o.s.e;
  std::vector<double> out(o.s.t * o.s.h, 7.0);
  FusedExpertsParams p = Params(o, Activation::kSilu, false, DType::kFloat64, o.x.data(), o.w1.data(), o.w2.data(),
                                nullptr, nullptr, o.tw.data());
  p.out = {out.data(), DType::kFloat64, {o.s.t, o.s.h}, {o.s.h, 1}};
  const Status status = FusedExperts(p, FusedExpertsConfig{});
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.message(), "fused_experts: topk_ids[1, 1] must be in [0, num_experts=4), got 4");
  for (double d : out) EXPECT_EQ(d, 7.0);
}

TEST(MoeRouter, TiesGoToTheLowestIdAndWeightsAreRenormalisedProbabilities) {
  const std::vector<float> gating = {0, 0, 0, 0, 1, 2, 2, 2};
  std::vector<float> weights(4);
  std::vector<int32_t> ids(4);
  for (bool renormalize : {true, false}) {
    MoeRouterParams p;
    p.gating = {gating.data(), DType::kFloat32, {2, 4}, {4, 1}};
    p.k = 2;
    p.renormalize = renormalize;
    p.weights = weights.data();
    p.ids = ids.data();
    ASSERT_TRUE(MoeRouter(p).ok());
    EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 1, 2}));
    const double p1 = std::exp(2.0) / (std::exp(1.0) + 3 * std::exp(2.0));
    EXPECT_NEAR(weights[0], renormalize ? 0.5 : 0.25, 1e-6);
    EXPECT_NEAR(weights[2], renormalize ? 0.5 : p1, 1e-6);
  }
}

TEST(FusedExpertsConfig, SpaceStartsWithTheHeuristicAndHoldsOnlyValidConfigs) {
  const FusedExpertsShape shape{4096, 1024, 2816, 16, 2};
  const FusedExpertsConfig heuristic = FusedExpertsHeuristicConfig(shape, DType::kBFloat16, CpuInfo{},
                                                                   FusedExpertsProduct::kForward);
  EXPECT_EQ(heuristic.task_rows, 1020);  // 2 x the 512 rows per expert, capped
  const std::vector<FusedExpertsConfig> space =
      FusedExpertsConfigSpace(shape, DType::kBFloat16, CpuInfo{}, FusedExpertsProduct::kBackward);
  ASSERT_GT(space.size(), 1u);
  EXPECT_EQ(space[0], heuristic);
  for (const FusedExpertsConfig& config : space) EXPECT_TRUE(config.Validate().ok());
  FusedExpertsConfig bad;
  bad.task_rows = 7;
  EXPECT_FALSE(bad.Validate().ok());
}

}  // namespace
}  // namespace tokamax
