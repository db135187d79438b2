#include "csrc/ops/dot_product_attention/dot_product_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "csrc/core/runtime/isa.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/core/base/test_util.h"

namespace tokamax {
namespace {

using testing::Buffer;
using testing::ScopedIsa;

struct Problem {
  int64_t batch = 1, q_len = 8, kv_len = 8, q_heads = 2, kv_heads = 1, head_dim = 16, value_dim = 16;
  bool causal = false;
  int64_t window_left = AttentionMasks::kUnbounded, window_right = AttentionMasks::kUnbounded;
  std::vector<int64_t> q_lengths, kv_lengths;  // empty: none
  int64_t segments = 0;                        // > 0: that many equal-length segments, both sides
  bool mask = false;                           // a random [T, S] bool mask broadcast over B, N
  bool bias = false;                           // a random [N, T, S] bias broadcast over B
  float soft_cap = 0.0f;
  bool head_major = false;                     // q and out as [B, N, T, H] transposed views
};

// All operands of one problem, filled deterministically; kernel and reference share the inputs.
struct Operands {
  Operands(const Problem& pb, DType dtype)
      : q(dtype, pb.batch * pb.q_len * pb.q_heads * pb.head_dim, 1),
        k(dtype, pb.batch * pb.kv_len * pb.kv_heads * pb.head_dim, 2),
        v(dtype, pb.batch * pb.kv_len * pb.kv_heads * pb.value_dim, 3),
        dout(dtype, pb.batch * pb.q_len * pb.q_heads * pb.value_dim, 1),
        bias(dtype, pb.q_heads * pb.q_len * pb.kv_len),
        mask(pb.q_len * pb.kv_len),
        q_segments(pb.batch * pb.q_len),
        kv_segments(pb.batch * pb.kv_len),
        dlse(pb.batch * pb.q_heads * pb.q_len) {
    testing::FillRandom(q, pb.batch * pb.q_len * pb.q_heads * pb.head_dim, 1);
    testing::FillRandom(k, pb.batch * pb.kv_len * pb.kv_heads * pb.head_dim, 2);
    testing::FillRandom(v, pb.batch * pb.kv_len * pb.kv_heads * pb.value_dim, 3);
    testing::FillRandom(dout, pb.batch * pb.q_len * pb.q_heads * pb.value_dim, 4);
    testing::FillRandom(bias, pb.q_heads * pb.q_len * pb.kv_len, 5);
    uint32_t state = 7;
    for (auto& m : mask) {
      state = state * 1664525u + 1013904223u;
      m = (state >> 28) % 4 != 0;  // 3 in 4 visible
    }
    for (size_t i = 0; i < dlse.size(); ++i) dlse[i] = 0.25f * std::sin(static_cast<float>(i));
    if (pb.segments > 0) {
      for (int64_t b = 0; b < pb.batch; ++b) {
        for (int64_t t = 0; t < pb.q_len; ++t) q_segments[b * pb.q_len + t] = static_cast<int32_t>(t * pb.segments / pb.q_len);
        for (int64_t s = 0; s < pb.kv_len; ++s) kv_segments[b * pb.kv_len + s] = static_cast<int32_t>(s * pb.segments / pb.kv_len);
      }
    }
  }
  Buffer q, k, v, dout, bias;
  std::vector<uint8_t> mask;
  std::vector<int32_t> q_segments, kv_segments;
  std::vector<float> dlse;
};

// Strides of a [B, T, N, H] tensor stored contiguously, or stored [B, N, T, H] (head-major).
void Layout(int64_t b, int64_t t, int64_t n, int64_t h, bool head_major, int64_t* strides) {
  (void)b;
  if (head_major) {
    strides[0] = n * t * h; strides[1] = h; strides[2] = t * h; strides[3] = 1;
  } else {
    strides[0] = t * n * h; strides[1] = n * h; strides[2] = h; strides[3] = 1;
  }
}

DotProductAttentionParams MakeParams(const Problem& pb, Operands& ops, void* out, DType out_dtype, float* lse) {
  DotProductAttentionParams p;
  const DType dtype = ops.q.dtype;
  p.q = {ops.q.data(), dtype, {pb.batch, pb.q_len, pb.q_heads, pb.head_dim}, {}};
  Layout(pb.batch, pb.q_len, pb.q_heads, pb.head_dim, pb.head_major, p.q.strides);
  p.k = {ops.k.data(), dtype, {pb.batch, pb.kv_len, pb.kv_heads, pb.head_dim}, {}};
  Layout(pb.batch, pb.kv_len, pb.kv_heads, pb.head_dim, false, p.k.strides);
  p.v = {ops.v.data(), dtype, {pb.batch, pb.kv_len, pb.kv_heads, pb.value_dim}, {}};
  Layout(pb.batch, pb.kv_len, pb.kv_heads, pb.value_dim, false, p.v.strides);
  if (pb.bias) {
    p.bias = {ops.bias.data(), dtype, {pb.batch, pb.q_heads, pb.q_len, pb.kv_len},
              {0, pb.q_len * pb.kv_len, pb.kv_len, 1}};
  }
  AttentionMasks& m = p.masks;
  m.is_causal = pb.causal;
  m.window_left = pb.window_left;
  m.window_right = pb.window_right;
  if (!pb.q_lengths.empty()) m.q_lengths = pb.q_lengths.data();
  if (!pb.kv_lengths.empty()) m.kv_lengths = pb.kv_lengths.data();
  if (pb.segments > 0) {
    m.q_segment_ids = ops.q_segments.data();
    m.q_segment_strides[0] = pb.q_len;
    m.q_segment_strides[1] = 1;
    m.kv_segment_ids = ops.kv_segments.data();
    m.kv_segment_strides[0] = pb.kv_len;
    m.kv_segment_strides[1] = 1;
  }
  if (pb.mask) {
    m.mask = ops.mask.data();
    m.mask_strides[2] = pb.kv_len;
    m.mask_strides[3] = 1;
  }
  p.scale = 1.0f / std::sqrt(static_cast<float>(pb.head_dim));
  p.logits_soft_cap = pb.soft_cap;
  p.out = {out, out_dtype, {pb.batch, pb.q_len, pb.q_heads, pb.value_dim}, {}};
  Layout(pb.batch, pb.q_len, pb.q_heads, pb.value_dim, pb.head_major, p.out.strides);
  p.lse = lse;
  p.lse_strides[0] = pb.q_heads * pb.q_len;
  p.lse_strides[1] = pb.q_len;
  p.lse_strides[2] = 1;
  return p;
}

// max |got - want| / max(max |want|, 1e-6) over `count` floats; NaN gives infinity.
// -inf matches -inf exactly (logsumexp of empty rows).
double LseError(const std::vector<float>& got, const std::vector<float>& want) {
  double max_diff = 0.0, max_ref = 1e-6;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    if (std::isnan(got[i])) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
  }
  return max_diff / max_ref;
}

double ForwardTolerance(DType dtype) {
  return dtype == DType::kFloat32 ? 2e-5 : (dtype == DType::kBFloat16 ? 1.6e-2 : 2e-3);
}
double BackwardTolerance(DType dtype) {
  return dtype == DType::kFloat32 ? 1e-4 : (dtype == DType::kBFloat16 ? 4e-2 : 6e-3);
}

// Runs the forward and backward kernels and the float64 reference; compares every output.
void Check(const Problem& pb, DType dtype, const DotProductAttentionConfig& config, bool backward = true,
           bool with_dlse = true) {
  SCOPED_TRACE("dtype " + std::string(DTypeName(dtype)) + " config " + std::to_string(config.block_q) + "," +
               std::to_string(config.block_kv) + "," + std::to_string(config.num_splits));
  Operands ops(pb, dtype);
  const int64_t out_count = pb.batch * pb.q_len * pb.q_heads * pb.value_dim;
  const int64_t rows = pb.batch * pb.q_heads * pb.q_len;
  Buffer out(dtype, out_count, 1), want_out(DType::kFloat64, out_count);
  testing::Poison(out, out_count);
  std::vector<float> lse(rows, std::nanf("")), want_lse(rows);
  DotProductAttentionParams p = MakeParams(pb, ops, out.data(), dtype, lse.data());
  const Status status = DotProductAttention(p, config);
  ASSERT_TRUE(status.ok()) << status.message();
  DotProductAttentionParams ref = MakeParams(pb, ops, want_out.data(), DType::kFloat64, want_lse.data());
  DotProductAttentionReference(ref);
  EXPECT_LE(testing::RelativeError(out, want_out, out_count), ForwardTolerance(dtype)) << "out";
  EXPECT_LE(LseError(lse, want_lse), 2e-5) << "logsumexp";
  if (!backward) return;

  const int64_t q_count = pb.batch * pb.q_len * pb.q_heads * pb.head_dim;
  const int64_t k_count = pb.batch * pb.kv_len * pb.kv_heads * pb.head_dim;
  const int64_t v_count = pb.batch * pb.kv_len * pb.kv_heads * pb.value_dim;
  const int64_t bias_count = pb.batch * pb.q_heads * pb.q_len * pb.kv_len;
  Buffer dq(dtype, q_count), dk(dtype, k_count), dv(dtype, v_count);
  Buffer want_dq(DType::kFloat64, q_count), want_dk(DType::kFloat64, k_count), want_dv(DType::kFloat64, v_count);
  testing::Poison(dq, q_count);
  testing::Poison(dk, k_count);
  testing::Poison(dv, v_count);
  std::vector<float> dbias(pb.bias ? bias_count : 0, std::nanf("")), want_dbias(dbias.size());
  auto grad_params = [&](const DotProductAttentionParams& forward, Buffer& gq, Buffer& gk, Buffer& gv, void* gbias) {
    DotProductAttentionGradParams g;
    g.forward = forward;
    g.dout = {ops.dout.data(), dtype, {pb.batch, pb.q_len, pb.q_heads, pb.value_dim}, {}};
    Layout(pb.batch, pb.q_len, pb.q_heads, pb.value_dim, false, g.dout.strides);
    if (with_dlse) {
      g.dlse = ops.dlse.data();
      g.dlse_strides[0] = pb.q_heads * pb.q_len;
      g.dlse_strides[1] = pb.q_len;
      g.dlse_strides[2] = 1;
    }
    g.dq = {gq.data(), gq.dtype, {pb.batch, pb.q_len, pb.q_heads, pb.head_dim}, {}};
    Layout(pb.batch, pb.q_len, pb.q_heads, pb.head_dim, pb.head_major, g.dq.strides);
    g.dk = {gk.data(), gk.dtype, {pb.batch, pb.kv_len, pb.kv_heads, pb.head_dim}, {}};
    Layout(pb.batch, pb.kv_len, pb.kv_heads, pb.head_dim, false, g.dk.strides);
    g.dv = {gv.data(), gv.dtype, {pb.batch, pb.kv_len, pb.kv_heads, pb.value_dim}, {}};
    Layout(pb.batch, pb.kv_len, pb.kv_heads, pb.value_dim, false, g.dv.strides);
    g.dbias = gbias;
    return g;
  };
  const Status grad_status =
      DotProductAttentionBackward(grad_params(p, dq, dk, dv, pb.bias ? static_cast<void*>(dbias.data()) : nullptr), config);
  ASSERT_TRUE(grad_status.ok()) << grad_status.message();
  DotProductAttentionBackwardReference(grad_params(ref, want_dq, want_dk, want_dv, pb.bias ? static_cast<void*>(want_dbias.data()) : nullptr));
  const double tol = BackwardTolerance(dtype);
  EXPECT_LE(testing::RelativeError(dq, want_dq, q_count), tol) << "dq";
  EXPECT_LE(testing::RelativeError(dk, want_dk, k_count), tol) << "dk";
  EXPECT_LE(testing::RelativeError(dv, want_dv, v_count), tol) << "dv";
  if (pb.bias) {
    EXPECT_LE(LseError(dbias, want_dbias), tol) << "dbias";
  }
  if (pb.bias && pb.batch > 1) {
    // A bias shared by the batches: the same gradients, summed over the batches in batch order.
    const int64_t shared_count = bias_count / pb.batch;
    std::vector<float> shared(shared_count, std::nanf("")), want_shared(shared_count, 0.0f);
    for (int64_t b = 0; b < pb.batch; ++b) {
      for (int64_t i = 0; i < shared_count; ++i) want_shared[i] += dbias[b * shared_count + i];
    }
    DotProductAttentionGradParams g = grad_params(p, dq, dk, dv, shared.data());
    g.dbias_sum_batches = true;
    const Status shared_status = DotProductAttentionBackward(g, config);
    ASSERT_TRUE(shared_status.ok()) << shared_status.message();
    EXPECT_EQ(shared, want_shared) << "dbias summed over the batches";
  }
}

DotProductAttentionConfig Config(int64_t block_q, int64_t block_kv, int64_t splits) {
  DotProductAttentionConfig c;
  c.block_q = block_q;
  c.block_kv = block_kv;
  c.num_splits = splits;
  return c;
}

class DotProductAttentionTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!IsaSupported(GetParam(), GetCpuInfo())) GTEST_SKIP() << IsaName(GetParam()) << " not supported here";
    SetParallelBackend(&testing::TwoThreadBackend);
  }
  void TearDown() override { SetParallelBackend(nullptr); }
};

TEST_P(DotProductAttentionTest, DenseAcrossDtypesAndTiles) {
  ScopedIsa isa(GetParam());
  Problem pb;
  pb.batch = 2; pb.q_len = 37; pb.kv_len = 53; pb.q_heads = 4; pb.kv_heads = 2; pb.head_dim = 24; pb.value_dim = 40;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    Check(pb, dtype, Config(8, 16, 1));
    Check(pb, dtype, Config(96, 256, 1));
    Check(pb, dtype, Config(5, 8, 3));
  }
}

// Head dims that fit whole bf16 tiles (H % 32, Hv % 16), where the avx512bf16 and amx tiers
// multiply bf16 on their bf16 product engine (bf16_gemm.h): tails of every kind, kv tiles starting off a 16-key boundary, splits, GQA.
TEST_P(DotProductAttentionTest, Bf16TileShapes) {
  ScopedIsa isa(GetParam());
  Problem pb;
  pb.batch = 2; pb.q_len = 50; pb.kv_len = 77; pb.q_heads = 6; pb.kv_heads = 2; pb.head_dim = 64; pb.value_dim = 48;
  Check(pb, DType::kBFloat16, Config(8, 24, 1));
  Check(pb, DType::kBFloat16, Config(32, 64, 2));
  pb.value_dim = 32;  // Hv % 32 == 0: the backward's products run on the engine too
  Check(pb, DType::kBFloat16, Config(8, 24, 1));
  pb.causal = true;
  Check(pb, DType::kBFloat16, Config(96, 256, 1));
  Check(pb, DType::kBFloat16, Config(16, 40, 3));
  pb.value_dim = 64; pb.head_dim = 256; pb.mask = true; pb.window_left = 30; pb.window_right = 5;
  Check(pb, DType::kBFloat16, Config(16, 64, 2));
  pb.q_len = 77; pb.kv_len = 31; pb.head_dim = 32; pb.value_dim = 16; pb.head_major = true; pb.soft_cap = 1.5f;
  pb.bias = true;
  Check(pb, DType::kBFloat16, Config(24, 16, 1));
}

TEST_P(DotProductAttentionTest, EveryMaskAloneAndCombined) {
  ScopedIsa isa(GetParam());
  Problem base;
  base.batch = 2; base.q_len = 45; base.kv_len = 45; base.q_heads = 6; base.kv_heads = 2; base.head_dim = 32;
  base.value_dim = 16;
  std::vector<Problem> problems;
  Problem causal = base; causal.causal = true; problems.push_back(causal);
  Problem window = base; window.window_left = 7; window.window_right = 3; problems.push_back(window);
  Problem lengths = base; lengths.q_lengths = {45, 20}; lengths.kv_lengths = {0, 31}; problems.push_back(lengths);
  Problem segments = base; segments.segments = 4; problems.push_back(segments);
  Problem mask = base; mask.mask = true; problems.push_back(mask);
  Problem bias = base; bias.bias = true; problems.push_back(bias);
  Problem cap = base; cap.soft_cap = 0.5f; cap.bias = true; problems.push_back(cap);
  Problem all = base;
  all.causal = true; all.window_left = 20; all.window_right = 0; all.q_lengths = {40, 45}; all.kv_lengths = {45, 30};
  all.segments = 3; all.mask = true; all.bias = true; all.soft_cap = 2.0f;
  problems.push_back(all);
  for (size_t i = 0; i < problems.size(); ++i) {
    SCOPED_TRACE("problem " + std::to_string(i));
    Check(problems[i], DType::kFloat32, Config(4, 8, 1));
    Check(problems[i], DType::kFloat32, Config(16, 16, 2));
    Check(problems[i], DType::kBFloat16, Config(8, 24, 1));
  }
}

TEST_P(DotProductAttentionTest, ShapesTailsAndLayouts) {
  ScopedIsa isa(GetParam());
  Problem decode;
  decode.q_len = 1; decode.kv_len = 300; decode.q_heads = 8; decode.kv_heads = 2; decode.head_dim = 64;
  decode.value_dim = 64;
  Check(decode, DType::kFloat32, Config(1, 32, 4));
  Check(decode, DType::kBFloat16, Config(1, 64, 3));
  decode.kv_lengths = {293};  // kv tiles off 16-key boundaries, a partial last tile
  decode.soft_cap = 3.0f;
  Check(decode, DType::kBFloat16, Config(1, 40, 2));
  Problem longer_q;  // T > S with a causal mask: late queries see every key
  longer_q.q_len = 70; longer_q.kv_len = 20; longer_q.causal = true; longer_q.head_dim = 8; longer_q.value_dim = 3;
  Check(longer_q, DType::kFloat32, Config(16, 8, 1));
  Problem mqa;
  mqa.q_len = 13; mqa.kv_len = 29; mqa.q_heads = 5; mqa.kv_heads = 1; mqa.head_dim = 7; mqa.value_dim = 9;
  mqa.head_major = true;
  Check(mqa, DType::kFloat32, Config(3, 8, 2));
  Check(mqa, DType::kFloat16, Config(3, 8, 1));
}

TEST_P(DotProductAttentionTest, FullyMaskedRowsGiveZerosAndFiniteGradients) {
  ScopedIsa isa(GetParam());
  Problem pb;
  pb.batch = 2; pb.q_len = 12; pb.kv_len = 12; pb.head_dim = 16; pb.value_dim = 16;
  pb.q_lengths = {5, 0};
  pb.kv_lengths = {12, 4};
  pb.window_left = 2; pb.window_right = 0;  // queries 7.. of batch 1 see nothing (keys >= 4 hidden)
  Check(pb, DType::kFloat32, Config(4, 8, 1));
  // Kernel output of the empty rows is exactly zero, logsumexp exactly -inf.
  Operands ops(pb, DType::kFloat32);
  const int64_t count = pb.batch * pb.q_len * pb.q_heads * pb.value_dim;
  Buffer out(DType::kFloat32, count);
  testing::Poison(out, count);
  std::vector<float> lse(pb.batch * pb.q_heads * pb.q_len, std::nanf(""));
  ASSERT_TRUE(DotProductAttention(MakeParams(pb, ops, out.data(), DType::kFloat32, lse.data()), Config(4, 8, 2)).ok());
  for (int64_t t = 0; t < pb.q_len; ++t) {
    for (int64_t n = 0; n < pb.q_heads; ++n) {
      EXPECT_EQ(lse[(1 * pb.q_heads + n) * pb.q_len + t], -std::numeric_limits<float>::infinity());
      for (int64_t e = 0; e < pb.value_dim; ++e) {
        EXPECT_EQ(out.Get(((1 * pb.q_len + t) * pb.q_heads + n) * pb.value_dim + e), 0.0f);
      }
    }
  }
}

TEST_P(DotProductAttentionTest, EmptySequences) {
  ScopedIsa isa(GetParam());
  Problem pb;
  pb.kv_len = 0;
  Check(pb, DType::kFloat32, Config(4, 8, 1));
  pb.kv_len = 5;
  pb.q_len = 0;
  Check(pb, DType::kFloat32, Config(4, 8, 1));
}

TEST_P(DotProductAttentionTest, BitwiseReproducibleAcrossThreadCounts) {
  ScopedIsa isa(GetParam());
  Problem pb;
  pb.batch = 1; pb.q_len = 64; pb.kv_len = 200; pb.q_heads = 4; pb.kv_heads = 2; pb.head_dim = 32; pb.value_dim = 32;
  pb.causal = true;
  Operands ops(pb, DType::kFloat32);
  const int64_t count = pb.q_len * pb.q_heads * pb.value_dim;
  Buffer a(DType::kFloat32, count), b(DType::kFloat32, count);
  std::vector<float> lse_a(pb.q_heads * pb.q_len), lse_b(lse_a.size());
  const DotProductAttentionConfig config = Config(8, 32, 3);
  ASSERT_TRUE(DotProductAttention(MakeParams(pb, ops, a.data(), DType::kFloat32, lse_a.data()), config).ok());
  SetParallelBackend(nullptr);
  ASSERT_TRUE(DotProductAttention(MakeParams(pb, ops, b.data(), DType::kFloat32, lse_b.data()), config).ok());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), count * sizeof(float)));
  EXPECT_EQ(lse_a, lse_b);
}

INSTANTIATE_TEST_SUITE_P(Tiers, DotProductAttentionTest,
                         ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx),
                         [](const ::testing::TestParamInfo<Isa>& info) { return std::string(IsaName(info.param)); });

TEST(DotProductAttentionConfigTest, ValidateAndRoundTrip) {
  DotProductAttentionConfig config;
  EXPECT_TRUE(config.Validate().ok());
  DotProductAttentionConfig parsed;
  ASSERT_TRUE(DotProductAttentionConfig::FromVector({32, 64, 2}, &parsed).ok());
  EXPECT_EQ(parsed.ToVector(), (std::vector<int64_t>{32, 64, 2}));
  const Status bad_kv = DotProductAttentionConfig::FromVector({32, 60, 1}, &parsed);
  EXPECT_NE(bad_kv.message().find("block_kv"), std::string::npos) << bad_kv.message();
  EXPECT_FALSE(DotProductAttentionConfig::FromVector({0, 64, 1}, &parsed).ok());
  EXPECT_FALSE(DotProductAttentionConfig::FromVector({32, 64, 0}, &parsed).ok());
  EXPECT_FALSE(DotProductAttentionConfig::FromVector({4096, 8192, 1}, &parsed).ok());
  EXPECT_FALSE(DotProductAttentionConfig::FromVector({32, 64}, &parsed).ok());
}

TEST(DotProductAttentionConfigTest, HeuristicsSplitDecodeAndStayValid) {
  CpuInfo cpu;
  DotProductAttentionShape decode{1, 1, 4096, 32, 8, 128, 128, false};
  const DotProductAttentionConfig fwd = DotProductAttentionHeuristicConfig(decode, DType::kFloat32, cpu, DotProductAttentionProduct::kForward);
  EXPECT_TRUE(fwd.Validate().ok());
  EXPECT_EQ(fwd.block_q, 1);
  DotProductAttentionShape single{1, 1, 4096, 4, 1, 128, 128, false};
  EXPECT_GT(DotProductAttentionHeuristicConfig(single, DType::kFloat32, cpu, DotProductAttentionProduct::kForward).num_splits, 1);
  DotProductAttentionShape prefill{1, 2048, 2048, 16, 16, 128, 128, true};
  const DotProductAttentionConfig pre = DotProductAttentionHeuristicConfig(prefill, DType::kBFloat16, cpu, DotProductAttentionProduct::kForward);
  EXPECT_EQ(pre.num_splits, 1);
  EXPECT_EQ(pre.block_q, 96);
  EXPECT_EQ(pre.block_kv % 32, 0);  // bf16: whole tiles of the bf16 engine (16 keys, 32 deep)
  // fp32: whole micro-kernel panels on every tier (mr 6 and 12), for the heuristic and the space.
  EXPECT_EQ(DotProductAttentionHeuristicConfig(prefill, DType::kFloat32, cpu, DotProductAttentionProduct::kForward).block_kv % 24, 0);
  EXPECT_EQ(DotProductAttentionHeuristicConfig(prefill, DType::kFloat32, cpu, DotProductAttentionProduct::kBackward).block_kv % 24, 0);
  for (const DotProductAttentionConfig& c : DotProductAttentionConfigSpace(prefill, DType::kFloat32, cpu, DotProductAttentionProduct::kForward)) {
    EXPECT_EQ(c.block_kv % 24, 0) << c.block_kv;
  }
  for (const DotProductAttentionConfig& c : DotProductAttentionConfigSpace(prefill, DType::kFloat32, cpu, DotProductAttentionProduct::kBackward)) {
    EXPECT_TRUE(c.Validate().ok());
  }
  EXPECT_GT(DotProductAttentionConfigSpace(prefill, DType::kFloat32, cpu, DotProductAttentionProduct::kForward).size(), 4u);
}

TEST(DotProductAttentionConfigTest, LengthsChecked) {
  const int64_t good[] = {0, 3, 5};
  EXPECT_TRUE(CheckAttentionLengths(good, 3, 5, "query_seq_lengths").ok());
  const int64_t bad[] = {0, 6};
  const Status status = CheckAttentionLengths(bad, 2, 5, "query_seq_lengths");
  EXPECT_NE(status.message().find("query_seq_lengths[1] = 6"), std::string::npos) << status.message();
  const int64_t negative[] = {-1};
  EXPECT_FALSE(CheckAttentionLengths(negative, 1, 5, "key_value_seq_lengths").ok());
}

}  // namespace
}  // namespace tokamax
