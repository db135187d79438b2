// gated_linear_unit's kernels on every tier and dtype against float64 oracles: the forward (with
// residuals, a transposed gate and a fused [K, 2, N] weight) for every config of the space, the
// backward's dx and dweights, activation names and config errors.
#include "csrc/ops/gated_linear_unit/gated_linear_unit.h"

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

constexpr int64_t kM = 37, kK = 45, kN = 53;

template <int N>
StridedView<N> View(const Buffer& b, std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t offset = 0) {
  StridedView<N> v;
  v.data = static_cast<const char*>(b.data()) + offset * DTypeSize(b.dtype);
  v.dtype = b.dtype;
  for (int d = 0; d < N; ++d) {
    v.sizes[d] = sizes[d];
    v.strides[d] = strides[d];
  }
  return v;
}

template <int N>
MutableStridedView<N> MutableView(Buffer& b, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                                  int64_t offset = 0) {
  MutableStridedView<N> v;
  v.data = static_cast<char*>(b.data()) + offset * DTypeSize(b.dtype);
  v.dtype = b.dtype;
  for (int d = 0; d < N; ++d) {
    v.sizes[d] = sizes[d];
    v.strides[d] = strides[d];
  }
  return v;
}

constexpr Activation kActivations[] = {Activation::kNone,     Activation::kRelu,    Activation::kSilu,
                                       Activation::kGeluTanh, Activation::kGeluErf, Activation::kSigmoid};

class GatedLinearUnitTest : public ::testing::TestWithParam<std::tuple<Isa, DType>> {};

TEST_P(GatedLinearUnitTest, ForwardMatchesFloat64OracleForEveryConfig) {
  const auto [isa, dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  testing::ScopedIsa scoped(isa);
  SetParallelBackend(&testing::TwoThreadBackend);
  // x [M, K]; weights fused [K, 2, N]; the gate read instead from a transposed [N, K] copy.
  Buffer x(dtype, kM * kK, 1), w(dtype, kK * 2 * kN), gate_t(dtype, kN * kK);
  testing::FillRandom(x, kM * kK, 1);
  testing::FillRandom(w, kK * 2 * kN, 2);
  for (int64_t q = 0; q < kK; ++q) {
    for (int64_t j = 0; j < kN; ++j) gate_t.Set(j * kK + q, w.Get(q * 2 * kN + j));
  }
  // The oracle in float64 from the same (rounded) inputs.
  Buffer xd(DType::kFloat64, kM * kK), wd(DType::kFloat64, kK * 2 * kN);
  for (int64_t i = 0; i < kM * kK; ++i) xd.Set(i, x.Get(i));
  for (int64_t i = 0; i < kK * 2 * kN; ++i) wd.Set(i, w.Get(i));
  const GatedLinearUnitShape shape{kM, kK, kN};
  for (const Activation activation : kActivations) {
    Buffer want(DType::kFloat64, kM * kN), want_res(DType::kFloat64, kM * 2 * kN);
    GatedLinearUnitParams oracle;
    oracle.x = View<2>(xd, {kM, kK}, {kK, 1});
    oracle.gate = View<2>(wd, {kK, kN}, {2 * kN, 1});
    oracle.up = View<2>(wd, {kK, kN}, {2 * kN, 1}, kN);
    oracle.activation = activation;
    oracle.out = MutableView<2>(want, {kM, kN}, {kN, 1});
    oracle.residuals = MutableView<3>(want_res, {kM, 2, kN}, {2 * kN, kN, 1});
    GatedLinearUnitReference(oracle);
    Buffer want_cast(dtype, kM * kN), want_res_cast(dtype, kM * 2 * kN);
    for (int64_t i = 0; i < kM * kN; ++i) want_cast.Set(i, want.Get(i));
    for (int64_t i = 0; i < kM * 2 * kN; ++i) want_res_cast.Set(i, want_res.Get(i));
    for (const GatedLinearUnitConfig& config :
         GatedLinearUnitConfigSpace(shape, dtype, GetCpuInfo(), GatedLinearUnitProduct::kForward)) {
      for (const bool transposed_gate : {false, true}) {
        Buffer out(dtype, kM * kN), res(dtype, kM * 2 * kN);
        testing::Poison(out, kM * kN);
        testing::Poison(res, kM * 2 * kN);
        GatedLinearUnitParams p;
        p.x = View<2>(x, {kM, kK}, {kK, 1});
        p.gate = transposed_gate ? View<2>(gate_t, {kK, kN}, {1, kK}) : View<2>(w, {kK, kN}, {2 * kN, 1});
        p.up = View<2>(w, {kK, kN}, {2 * kN, 1}, kN);
        p.activation = activation;
        p.out = MutableView<2>(out, {kM, kN}, {kN, 1});
        p.residuals = MutableView<3>(res, {kM, 2, kN}, {2 * kN, kN, 1});
        ASSERT_TRUE(GatedLinearUnit(p, config).ok());
        const std::string where = "activation " + std::to_string(static_cast<int>(activation)) + " config " +
                                  std::to_string(config.block_m) + "," + std::to_string(config.block_n);
        EXPECT_LE(testing::RelativeError(out, want_cast, kM * kN), testing::Tolerance(dtype)) << where;
        EXPECT_LE(testing::RelativeError(res, want_res_cast, kM * 2 * kN), testing::Tolerance(dtype)) << where;
      }
    }
  }
  SetParallelBackend(nullptr);
}

TEST_P(GatedLinearUnitTest, BackwardMatchesFloat64Oracle) {
  const auto [isa, dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  testing::ScopedIsa scoped(isa);
  Buffer x(dtype, kM * kK), w(dtype, kK * 2 * kN), dout(dtype, kM * kN), res(dtype, kM * 2 * kN);
  testing::FillRandom(x, kM * kK, 3);
  testing::FillRandom(w, kK * 2 * kN, 4);
  testing::FillRandom(dout, kM * kN, 5);
  testing::FillRandom(res, kM * 2 * kN, 6);  // the residuals as given: the backward's only view of the forward
  const GatedLinearUnitShape shape{kM, kK, kN};
  const GatedLinearUnitConfig config =
      GatedLinearUnitHeuristicConfig(shape, dtype, GetCpuInfo(), GatedLinearUnitProduct::kBackward);
  for (const Activation activation : kActivations) {
    std::vector<double> dpre(kM * 2 * kN);
    for (int64_t i = 0; i < kM; ++i) {
      for (int64_t j = 0; j < kN; ++j) {
        const double g = res.Get(i * 2 * kN + j), u = res.Get(i * 2 * kN + kN + j), dy = dout.Get(i * kN + j);
        // The oracle rounds dpre to the dtype, as the kernel's GEMM operand is.
        Buffer r(dtype, 2);
        r.Set(0, static_cast<float>(dy * u * ActivationDerivative(activation, g)));
        r.Set(1, static_cast<float>(dy * Activate(activation, g)));
        dpre[i * 2 * kN + j] = r.Get(0);
        dpre[i * 2 * kN + kN + j] = r.Get(1);
      }
    }
    Buffer want_dx(dtype, kM * kK), want_dw(dtype, kK * 2 * kN);
    for (int64_t i = 0; i < kM; ++i) {
      for (int64_t q = 0; q < kK; ++q) {
        double sum = 0.0;
        for (int64_t c = 0; c < 2 * kN; ++c) sum += dpre[i * 2 * kN + c] * w.Get(q * 2 * kN + c);
        want_dx.Set(i * kK + q, static_cast<float>(sum));
      }
    }
    for (int64_t q = 0; q < kK; ++q) {
      for (int64_t c = 0; c < 2 * kN; ++c) {
        double sum = 0.0;
        for (int64_t i = 0; i < kM; ++i) sum += x.Get(i * kK + q) * dpre[i * 2 * kN + c];
        want_dw.Set(q * 2 * kN + c, static_cast<float>(sum));
      }
    }
    Buffer dpre_buf(dtype, kM * 2 * kN), dx(dtype, kM * kK), dw(dtype, kK * 2 * kN);
    testing::Poison(dx, kM * kK);
    testing::Poison(dw, kK * 2 * kN);
    GatedLinearUnitBackwardParams p;
    p.dout = View<2>(dout, {kM, kN}, {kN, 1});
    p.x = View<2>(x, {kM, kK}, {kK, 1});
    p.weights = View<2>(w, {kK, 2 * kN}, {2 * kN, 1});
    p.residuals = View<3>(res, {kM, 2, kN}, {2 * kN, kN, 1});
    p.activation = activation;
    p.dpre = MutableView<2>(dpre_buf, {kM, 2 * kN}, {2 * kN, 1});
    p.dx = MutableView<2>(dx, {kM, kK}, {kK, 1});
    p.dweights = MutableView<2>(dw, {kK, 2 * kN}, {2 * kN, 1});
    ASSERT_TRUE(GatedLinearUnitBackward(p, config).ok());
    // bf16 / fp16 dpre may round differently from the oracle's by one ulp of the dtype.
    EXPECT_LE(testing::RelativeError(dx, want_dx, kM * kK), 2 * testing::Tolerance(dtype));
    EXPECT_LE(testing::RelativeError(dw, want_dw, kK * 2 * kN), 2 * testing::Tolerance(dtype));
  }
}

INSTANTIATE_TEST_SUITE_P(AllTiers, GatedLinearUnitTest,
                         ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512,
                                                              Isa::kAvx512Bf16, Isa::kAmx),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16,
                                                              DType::kFloat16)),
                         [](const auto& info) {
                           return std::string(IsaName(std::get<0>(info.param))) + "_" +
                                  DTypeName(std::get<1>(info.param));
                         });

TEST(GatedLinearUnitActivationTest, NamesAndErrors) {
  Activation a;
  ASSERT_TRUE(ParseGluActivation("swish", &a).ok());
  EXPECT_EQ(a, Activation::kSilu);
  ASSERT_TRUE(ParseGluActivation("gelu", &a).ok());
  EXPECT_EQ(a, Activation::kGeluTanh);
  ASSERT_TRUE(ParseGluActivation("gelu_exact", &a).ok());
  EXPECT_EQ(a, Activation::kGeluErf);
  const Status bad = ParseGluActivation("tanh", &a);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("got 'tanh'"), std::string::npos) << bad.message();
}

// A decode-sized forward whose weights are read in place takes the GEMM core's streaming
// blocking; the same sizes through transposed views (packed) keep the packed blocking, and so do
// many rows. Valid either way.
TEST(GatedLinearUnitConfigTest, FewRowForwardOnContiguousWeightsStreamsThem) {
  CpuInfo cpu;
  cpu.vendor = "amd";
  cpu.family = 0x1a;
  cpu.avx512bf16 = true;
  GatedLinearUnitShape decode{4, 2048, 5632};
  const StreamingBlocking streaming = InPlaceBlocking(4, DType::kFloat32, cpu);
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    decode.weights_in_place = true;
    const GatedLinearUnitConfig in_place =
        GatedLinearUnitHeuristicConfig(decode, dtype, cpu, GatedLinearUnitProduct::kForward);
    EXPECT_EQ(in_place.block_k, streaming.block_k) << DTypeName(dtype);
    EXPECT_EQ(in_place.block_n, streaming.block_n) << DTypeName(dtype);
    EXPECT_TRUE(in_place.Validate().ok()) << in_place.Validate().message();
    decode.weights_in_place = false;
    const GatedLinearUnitConfig views = GatedLinearUnitHeuristicConfig(decode, dtype, cpu, GatedLinearUnitProduct::kForward);
    EXPECT_EQ(views.block_k, 256) << DTypeName(dtype);
    EXPECT_TRUE(views.Validate().ok()) << views.Validate().message();
  }
  // bf16 from one 16-row tile runs on the dot engine, which packs B: no streaming blocking.
  const GatedLinearUnitShape tile_rows{32, 2048, 5632};
  EXPECT_EQ(GatedLinearUnitHeuristicConfig(tile_rows, DType::kBFloat16, cpu, GatedLinearUnitProduct::kForward).block_k,
            256);
  const GatedLinearUnitShape many{4096, 2048, 5632};
  EXPECT_EQ(GatedLinearUnitHeuristicConfig(many, DType::kFloat32, cpu, GatedLinearUnitProduct::kForward).block_k, 256);
}

TEST(GatedLinearUnitConfigTest, SpaceIsValidDistinctAndStartsWithTheHeuristic) {
  const GatedLinearUnitShape shape{4096, 2048, 5632};
  for (const auto product : {GatedLinearUnitProduct::kForward, GatedLinearUnitProduct::kBackward}) {
    const auto space = GatedLinearUnitConfigSpace(shape, DType::kFloat32, GetCpuInfo(), product);
    ASSERT_GT(space.size(), 1u);
    EXPECT_EQ(space[0], GatedLinearUnitHeuristicConfig(shape, DType::kFloat32, GetCpuInfo(), product));
    for (size_t i = 0; i < space.size(); ++i) {
      EXPECT_TRUE(space[i].Validate().ok()) << space[i].Validate().message();
      for (size_t j = 0; j < i; ++j) EXPECT_NE(space[i], space[j]);
    }
  }
  GatedLinearUnitConfig config;
  config.task_m = config.block_m + 1;
  EXPECT_NE(config.Validate().message().find("task_m"), std::string::npos);
}

}  // namespace
}  // namespace tokamax
