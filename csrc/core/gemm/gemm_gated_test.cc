// The gated product (GemmGate, gemm.h) on every tier, dtype and activation against a float64
// oracle built on ReferenceGemm: activation(scale·A·B + bias) · (scale·A·up + up_bias) with A read
// through a row gather, C's rows scattered, the pre-activations written into a fused [M, 2, N]
// buffer, tails of every tile and column group, B read packed, in place and as a transposed
// view (in regions of kGemmDotMaxRows rows: the column-dot form), and a region whose columns are written by two calls. The gated sums are the plain
// product's, bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

constexpr Activation kActivations[] = {Activation::kNone,     Activation::kRelu,    Activation::kSilu,
                                       Activation::kGeluTanh, Activation::kGeluErf, Activation::kSigmoid};

class GemmGatedTest : public ::testing::TestWithParam<std::tuple<Isa, DType, Activation>> {};

TEST_P(GemmGatedTest, MatchesFloat64Oracle) {
  const auto [isa, dtype, activation] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  // 29 rows (tails of the 6-, 12- and 16-row tiles) gathered from 41, K = 37, N = 70 (two
  // whole 32-wide groups and a 6-wide tail; four 16-wide ones and a tail).
  const int64_t m = 29, src_rows = 41, k = 37, n = 70, split = 38;
  Buffer src(dtype, src_rows * k, 1), gate_b(dtype, k * n, 3), up_b(dtype, k * n, 2);
  testing::FillRandom(src, src_rows * k, 1);
  testing::FillRandom(gate_b, k * n, 2);
  testing::FillRandom(up_b, k * n, 3);
  std::vector<int64_t> a_row_map(m), c_row_map(m);
  for (int64_t i = 0; i < m; ++i) a_row_map[i] = (i * 7 + 3) % 23;  // rows repeat past 23
  for (int64_t i = 0; i < m; ++i) c_row_map[i] = (i * 11) % m;      // a permutation
  std::vector<float> bias(n), up_bias(n);
  for (int64_t j = 0; j < n; ++j) bias[j] = 0.05f * static_cast<float>(j % 7) - 0.1f;
  for (int64_t j = 0; j < n; ++j) up_bias[j] = 0.03f * static_cast<float>(j % 5) - 0.05f;
  const ConstMatrix am{src.data(), dtype, m, k, k, 1};

  // The oracle: float64 products on the gathered copy of A.
  Buffer copy(dtype, m * k);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t p = 0; p < k; ++p) copy.Set(i * k + p, src.Get(a_row_map[i] * k + p));
  }
  const ConstMatrix copy_m{copy.data(), dtype, m, k, k, 1};
  std::vector<double> gate_product(m * n), up_product(m * n);
  ReferenceGemm(copy_m, {gate_b.data(), dtype, k, n, n, 1}, {gate_product.data(), DType::kFloat64, m, n, n, 1});
  ReferenceGemm(copy_m, {up_b.data(), dtype, k, n, n, 1}, {up_product.data(), DType::kFloat64, m, n, n, 1});
  const float scale = 0.75f;
  Buffer want(dtype, m * n), want_gate(dtype, m * n), want_up(dtype, m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double g = scale * gate_product[i * n + j] + bias[j], u = scale * up_product[i * n + j] + up_bias[j];
      want.Set(c_row_map[i] * n + j, static_cast<float>(Activate(activation, g) * u));
      want_gate.Set(c_row_map[i] * n + j, static_cast<float>(g));
      want_up.Set(c_row_map[i] * n + j, static_cast<float>(u));
    }
  }

  // B and up also as transposed views of [N, K] storage (an nn.Linear weight).
  Buffer gate_t(dtype, n * k), up_t(dtype, n * k);
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t j = 0; j < n; ++j) {
      gate_t.Set(j * k + p, gate_b.Get(p * n + j));
      up_t.Set(j * k + p, up_b.Get(p * n + j));
    }
  }
  const GemmKernels& kernels = GetGemmKernels(isa);
  GemmPrologue gather;
  gather.a_row_map = a_row_map.data();
  for (const bool transposed : {false, true}) {
    const ConstMatrix bm = transposed ? ConstMatrix{gate_t.data(), dtype, k, n, 1, k}
                                      : ConstMatrix{gate_b.data(), dtype, k, n, n, 1};
    const ConstMatrix upm = transposed ? ConstMatrix{up_t.data(), dtype, k, n, 1, k}
                                       : ConstMatrix{up_b.data(), dtype, k, n, n, 1};
    for (const GemmBlocking& blocking : {GemmBlocking{12, 16, 16, true}, GemmBlocking{12, 16, 48, false},
                                         GemmBlocking{}}) {
      const std::string where = "transposed=" + std::to_string(transposed) +
                                " block_n=" + std::to_string(blocking.block_n) +
                                " pack_b=" + std::to_string(blocking.pack_b);
      Buffer c(dtype, m * n), pre(dtype, m * 2 * n);  // pre-activations [M, 2, N]
      testing::Poison(c, m * n);
      testing::Poison(pre, m * 2 * n);
      GemmGate gate;
      gate.up = upm;
      gate.up_bias = up_bias.data();
      gate.gate_out = {pre.data(), dtype, m, n, 2 * n, 1};
      gate.up_out = {static_cast<char*>(pre.data()) + n * DTypeSize(dtype), dtype, m, n, 2 * n, 1};
      GemmEpilogue epilogue;
      epilogue.scale = scale;
      epilogue.bias = bias.data();
      epilogue.activation = activation;
      epilogue.row_map = c_row_map.data();
      epilogue.gate = &gate;
      const MutableMatrix cm{c.data(), dtype, m, n, n, 1};
      // Regions of kGemmDotMaxRows rows: on transposed views read in place, the column-dot form.
      const int64_t region_rows = blocking.pack_b ? m : kGemmDotMaxRows;
      for (int64_t r0 = 0; r0 < m; r0 += region_rows) {
        const int64_t r1 = std::min(m, r0 + region_rows);
        GemmRegion(kernels, am, bm, cm, r0, r1, 0, split, blocking, epilogue, gather);
        GemmRegion(kernels, am, bm, cm, r0, r1, split, n, blocking, epilogue, gather);
      }
      EXPECT_LE(testing::RelativeError(c, want, m * n), testing::Tolerance(dtype)) << where;
      Buffer got_gate(dtype, m * n), got_up(dtype, m * n);
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          got_gate.Set(r * n + j, pre.Get(r * 2 * n + j));
          got_up.Set(r * n + j, pre.Get(r * 2 * n + n + j));
        }
      }
      EXPECT_LE(testing::RelativeError(got_gate, want_gate, m * n), testing::Tolerance(dtype)) << where;
      EXPECT_LE(testing::RelativeError(got_up, want_up, m * n), testing::Tolerance(dtype)) << where;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllTiers, GemmGatedTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::ValuesIn(kActivations)),
    [](const auto& info) {
      return std::string(IsaName(std::get<0>(info.param))) + "_" + DTypeName(std::get<1>(info.param)) + "_" +
             ActivationName(std::get<2>(info.param));
    });

// The gated sums are those of the plain product: with scale 1 and no bias, fp32 pre-activations
// are bitwise GemmRegion's C on B and on up alone, whatever the blocking reads B as.
class GemmGatedBitsTest : public ::testing::TestWithParam<std::tuple<Isa, DType>> {};

TEST_P(GemmGatedBitsTest, PreActivationsAreThePlainProducts) {
  const auto [isa, dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const int64_t m = 40, k = 300, n = 77;  // several depth slices of block_k = 256
  Buffer a(dtype, m * k), gate_b(dtype, k * n), up_b(dtype, k * n);
  testing::FillRandom(a, m * k, 4);
  testing::FillRandom(gate_b, k * n, 5);
  testing::FillRandom(up_b, k * n, 6);
  const ConstMatrix am{a.data(), dtype, m, k, k, 1}, bm{gate_b.data(), dtype, k, n, n, 1},
      upm{up_b.data(), dtype, k, n, n, 1};
  const GemmKernels& kernels = GetGemmKernels(isa);
  for (const GemmBlocking& blocking : {GemmBlocking{}, GemmBlocking{24, 64, 32, false}}) {
    std::vector<float> plain_gate(m * n), plain_up(m * n), gate_out(m * n), up_out(m * n), c(m * n);
    GemmRegion(kernels, am, bm, {plain_gate.data(), DType::kFloat32, m, n, n, 1}, 0, m, 0, n, blocking);
    GemmRegion(kernels, am, upm, {plain_up.data(), DType::kFloat32, m, n, n, 1}, 0, m, 0, n, blocking);
    GemmGate gate;
    gate.up = upm;
    gate.gate_out = {gate_out.data(), DType::kFloat32, m, n, n, 1};
    gate.up_out = {up_out.data(), DType::kFloat32, m, n, n, 1};
    GemmEpilogue epilogue;
    epilogue.activation = Activation::kNone;
    epilogue.gate = &gate;
    GemmRegion(kernels, am, bm, {c.data(), DType::kFloat32, m, n, n, 1}, 0, m, 0, n, blocking, epilogue);
    EXPECT_EQ(std::memcmp(gate_out.data(), plain_gate.data(), m * n * sizeof(float)), 0) << blocking.block_n;
    EXPECT_EQ(std::memcmp(up_out.data(), plain_up.data(), m * n * sizeof(float)), 0) << blocking.block_n;
    for (int64_t i = 0; i < m * n; ++i) ASSERT_EQ(c[i], plain_gate[i] * plain_up[i]) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(AllTiers, GemmGatedBitsTest,
                         ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512,
                                                              Isa::kAvx512Bf16, Isa::kAmx),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         [](const auto& info) {
                           return std::string(IsaName(std::get<0>(info.param))) + "_" +
                                  DTypeName(std::get<1>(info.param));
                         });

// The float64 path: every activation in double, exactly the oracle's formula.
TEST(GemmGatedFloat64Test, ExactInDouble) {
  const int64_t m = 3, k = 2, n = 2;
  const double a[m * k] = {1, 2, -3, 4, 0.5, -1};
  const double b[k * n] = {1, -1, 2, 0.25};
  const double up[k * n] = {0.5, 2, -1, 3};
  const float bias[n] = {0.5f, -2.0f}, up_bias[n] = {0.25f, 1.0f};
  const int64_t row_map[m] = {2, 0, 1};
  for (const Activation activation : kActivations) {
    double c[m * n] = {}, pre[m * 2 * n] = {};
    GemmGate gate;
    gate.up = {up, DType::kFloat64, k, n, n, 1};
    gate.up_bias = up_bias;
    gate.gate_out = {pre, DType::kFloat64, m, n, 2 * n, 1};
    gate.up_out = {pre + n, DType::kFloat64, m, n, 2 * n, 1};
    GemmEpilogue e;
    e.scale = 2.0f;
    e.bias = bias;
    e.activation = activation;
    e.row_map = row_map;
    e.gate = &gate;
    GemmRegion(GetGemmKernels(Isa::kScalar), {a, DType::kFloat64, m, k, k, 1}, {b, DType::kFloat64, k, n, n, 1},
               {c, DType::kFloat64, m, n, n, 1}, 0, m, 0, n, GemmBlocking{}, e);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const double g = 2.0 * (a[i * k] * b[j] + a[i * k + 1] * b[n + j]) + bias[j];
        const double u = 2.0 * (a[i * k] * up[j] + a[i * k + 1] * up[n + j]) + up_bias[j];
        EXPECT_EQ(c[row_map[i] * n + j], Activate(activation, g) * u) << ActivationName(activation) << i << j;
        EXPECT_EQ(pre[row_map[i] * 2 * n + j], g);
        EXPECT_EQ(pre[row_map[i] * 2 * n + n + j], u);
      }
    }
  }
}

}  // namespace
}  // namespace tokamax
