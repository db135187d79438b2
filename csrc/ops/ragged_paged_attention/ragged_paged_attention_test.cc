// ragged_paged_attention against a float64 loop over the spec: every tier, fp32 / bf16 / fp16,
// every config of the space (row products, splits, the GEMM path), two threads; index errors
// leave the cache untouched.
#include "csrc/ops/ragged_paged_attention/ragged_paged_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/base/test_util.h"

namespace tokamax {
namespace {

constexpr int64_t kHq = 6, kHkv = 2, kD = 32, kPageSize = 4, kPagesPerSeq = 12;
// Sequences: two decodes, a prefill of 40 tokens (the GEMM path at the heuristic), a mixed chunk.
const std::vector<int64_t> kQLens = {1, 1, 40, 5};
const std::vector<int64_t> kKvLens = {37, 6, 45, 19};
constexpr int64_t kPadding = 2;

struct Problem {
  DType dtype;
  int64_t tokens = 0, pages = 0;
  testing::Buffer q, k, v, cache;
  std::vector<int64_t> kv_lens = kKvLens, page_indices, cu_q_lens{0}, distribution{2, 2, 4};
  explicit Problem(DType dtype)
      : dtype(dtype), tokens(47 + kPadding), pages(4 * kPagesPerSeq + 1), q(dtype, tokens * kHq * kD, 1),
        k(dtype, tokens * kHkv * kD), v(dtype, tokens * kHkv * kD), cache(dtype, pages * kPageSize * 2 * kHkv * kD) {
    testing::FillRandom(q, tokens * kHq * kD, 1);
    testing::FillRandom(k, tokens * kHkv * kD, 2);
    testing::FillRandom(v, tokens * kHkv * kD, 3);
    testing::FillRandom(cache, pages * kPageSize * 2 * kHkv * kD, 4);
    for (int64_t i = 0; i < 4 * kPagesPerSeq; ++i) page_indices.push_back((i * 5 + 3) % pages);  // scattered, distinct
    for (int64_t n : kQLens) cu_q_lens.push_back(cu_q_lens.back() + n);
  }
  RaggedPagedAttentionParams Params(void* out, float* lse) {
    RaggedPagedAttentionParams p;
    p.queries = {q.data(), dtype, {tokens, kHq, kD}, {kHq * kD, kD, 1}};
    p.keys = {k.data(), dtype, {tokens, kHkv, kD}, {kHkv * kD, kD, 1}};
    p.values = {v.data(), dtype, {tokens, kHkv, kD}, {kHkv * kD, kD, 1}};
    p.kv_cache = {cache.data(), dtype, {pages, kPageSize, 2 * kHkv, kD}, {kPageSize * 2 * kHkv * kD, 2 * kHkv * kD, kD, 1}};
    auto index = [](const std::vector<int64_t>& x) { return KvCacheSlots{x.data(), true, static_cast<int64_t>(x.size()), 1}; };
    p.kv_lens = index(kv_lens);
    p.page_indices = index(page_indices);
    p.cu_q_lens = index(cu_q_lens);
    p.distribution = index(distribution);
    p.out = {out, dtype, {tokens, kHq, kD}, {kHq * kD, kD, 1}};
    p.lse = {lse, DType::kFloat32, {tokens, kHq}, {kHq, 1}};
    return p;
  }
};

// out and lse in float64, the cache as the kernel must leave it (new tokens written), from the spec.
void Oracle(const Problem& pb, bool causal, int64_t window, std::vector<double>* out, std::vector<double>* lse) {
  const int64_t row = 2 * kHkv * kD;
  std::vector<double> cache(pb.pages * kPageSize * row);
  for (size_t i = 0; i < cache.size(); ++i) cache[i] = pb.cache.Get(static_cast<int64_t>(i));
  auto slot = [&](int64_t s, int64_t pos) { return pb.page_indices[s * kPagesPerSeq + pos / kPageSize] * kPageSize + pos % kPageSize; };
  out->assign(pb.tokens * kHq * kD, 0.0);
  lse->assign(pb.tokens * kHq, -std::numeric_limits<double>::infinity());
  for (int64_t s = 0; s < 4; ++s) {
    for (int64_t i = 0; i < kQLens[s]; ++i) {
      const int64_t t = pb.cu_q_lens[s] + i, at = slot(s, kKvLens[s] - kQLens[s] + i);
      for (int64_t h = 0; h < kHkv; ++h) {
        for (int64_t e = 0; e < kD; ++e) {
          cache[at * row + (2 * h) * kD + e] = pb.k.Get((t * kHkv + h) * kD + e);
          cache[at * row + (2 * h + 1) * kD + e] = pb.v.Get((t * kHkv + h) * kD + e);
        }
      }
    }
  }
  for (int64_t s = 0; s < 4; ++s) {
    for (int64_t i = 0; i < kQLens[s]; ++i) {
      const int64_t t = pb.cu_q_lens[s] + i, pos = kKvLens[s] - kQLens[s] + i;
      for (int64_t n = 0; n < kHq; ++n) {
        const int64_t h = n / (kHq / kHkv);
        std::vector<double> logits;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j < kKvLens[s]; ++j) {
          if ((causal && j > pos) || (window > 0 && j <= pos - window)) continue;
          double dot = 0;
          for (int64_t e = 0; e < kD; ++e) dot += pb.q.Get((t * kHq + n) * kD + e) * cache[slot(s, j) * row + 2 * h * kD + e];
          logits.push_back(dot * 0.3);
          keys.push_back(j);
        }
        double max = -std::numeric_limits<double>::infinity(), sum = 0;
        for (double x : logits) max = std::max(max, x);
        for (double x : logits) sum += std::exp(x - max);
        (*lse)[t * kHq + n] = max + std::log(sum);
        for (size_t c = 0; c < keys.size(); ++c) {
          const double w = std::exp(logits[c] - max) / sum;
          for (int64_t e = 0; e < kD; ++e) (*out)[(t * kHq + n) * kD + e] += w * cache[slot(s, keys[c]) * row + (2 * h + 1) * kD + e];
        }
      }
    }
  }
}

class RaggedPagedAttentionTest : public ::testing::TestWithParam<std::tuple<Isa, DType>> {
 protected:
  void SetUp() override {
    if (!IsaSupported(std::get<0>(GetParam()), GetCpuInfo())) GTEST_SKIP() << "tier not supported here";
    SetParallelBackend(&testing::TwoThreadBackend);
  }
  void TearDown() override { SetParallelBackend(nullptr); }
};

TEST_P(RaggedPagedAttentionTest, EveryConfigMatchesTheFloat64Oracle) {
  const auto [isa, dtype] = GetParam();
  testing::ScopedIsa scoped(isa);
  RaggedPagedAttentionShape shape{47 + kPadding, kHq, kHkv, kD, 4 * kPagesPerSeq + 1, kPageSize, 4, kPagesPerSeq};
  for (const bool causal : {true, false}) {
    for (const int64_t window : {int64_t{0}, int64_t{9}}) {
      std::vector<double> want_out, want_lse;
      Oracle(Problem(dtype), causal, window, &want_out, &want_lse);
      for (const RaggedPagedAttentionConfig& config :
           RaggedPagedAttentionConfigSpace(shape, dtype, GetCpuInfo(), RaggedPagedAttentionProduct::kForward)) {
        Problem pb(dtype);
        testing::Buffer out(dtype, pb.tokens * kHq * kD);
        std::vector<float> lse(pb.tokens * kHq);
        RaggedPagedAttentionParams p = pb.Params(out.data(), lse.data());
        p.causal = causal;
        p.sliding_window = window;
        p.sm_scale = 0.3f;
        const Status status = RaggedPagedAttention(p, config);
        ASSERT_TRUE(status.ok()) << status.message();
        const double tol = 2 * testing::Tolerance(dtype);
        for (int64_t i = 0; i < pb.tokens * kHq * kD; ++i) {
          ASSERT_NEAR(out.Get(i), want_out[i], tol * (1 + std::abs(want_out[i])))
              << "element " << i << " config block_kv " << config.block_kv << " split_kv " << config.split_kv;
        }
        for (int64_t i = 0; i < pb.tokens * kHq; ++i) {
          if (std::isinf(want_lse[i])) {
            ASSERT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "padding row " << i;
          } else {
            ASSERT_NEAR(lse[i], want_lse[i], tol * (1 + std::abs(want_lse[i]))) << "lse row " << i;
          }
        }
      }
    }
  }
}

TEST_P(RaggedPagedAttentionTest, IndexErrorsWriteNothing) {
  const auto [isa, dtype] = GetParam();
  testing::ScopedIsa scoped(isa);
  struct Case {
    const char* message;
    void (*spoil)(Problem&);
  };
  const Case cases[] = {
      {"page_indices[24]", [](Problem& p) { p.page_indices[24] = p.pages; }},
      {"kv_lens[2] must be in [q_len", [](Problem& p) { p.kv_lens[2] = 39; }},
      {"cu_q_lens must be non-decreasing", [](Problem& p) { p.cu_q_lens[2] = 0; }},
      {"distribution must be the cumulative", [](Problem& p) { p.distribution = {3, 2, 4}; }},
      {"decode sequence 2", [](Problem& p) { p.distribution = {3, 3, 4}; }},
      {"must not repeat a slot", [](Problem& p) { p.page_indices[3 * kPagesPerSeq + 4] = p.page_indices[9]; }},
  };
  for (const Case& c : cases) {
    Problem pb(dtype);
    c.spoil(pb);
    const int64_t bytes = pb.pages * kPageSize * 2 * kHkv * kD * DTypeSize(dtype);
    const std::vector<char> before(static_cast<const char*>(pb.cache.data()),
                                   static_cast<const char*>(pb.cache.data()) + bytes);
    testing::Buffer out(dtype, pb.tokens * kHq * kD);
    std::vector<float> lse(pb.tokens * kHq);
    const Status status = RaggedPagedAttention(pb.Params(out.data(), lse.data()), RaggedPagedAttentionConfig());
    ASSERT_FALSE(status.ok()) << c.message;
    EXPECT_NE(status.message().find(c.message), std::string::npos) << status.message();
    EXPECT_EQ(std::memcmp(before.data(), pb.cache.data(), static_cast<size_t>(bytes)), 0) << c.message;
  }
}

TEST(RaggedPagedAttentionConfigTest, SplitMustBeAMultipleOfTheBlock) {
  RaggedPagedAttentionConfig config;
  config.block_kv = 64;
  config.split_kv = 96;
  EXPECT_NE(config.Validate().message().find("split_kv must be a multiple of block_kv"), std::string::npos);
  config.split_kv = 0;
  EXPECT_TRUE(config.Validate().ok());
}

TEST(RaggedPagedAttentionConfigTest, DecodeStagesOnlyWhereMeasuredToGain) {
  // Staging measured faster on Zen 5 and slower on Zen 4; Intel was measured in place only.
  RaggedPagedAttentionShape decode;
  decode.tokens = decode.num_seqs = 32;
  decode.q_heads = 32;
  decode.kv_heads = 8;
  decode.head_dim = 128;
  decode.page_size = 16;
  decode.pages_per_seq = 512;
  decode.total_pages = 32 * 512;
  auto stage_rows = [&](const char* vendor, int family, DType dtype) {
    CpuInfo cpu;
    cpu.vendor = vendor;
    cpu.family = family;
    return RaggedPagedAttentionHeuristicConfig(decode, dtype, cpu, RaggedPagedAttentionProduct::kForward).stage_rows;
  };
  EXPECT_EQ(stage_rows("amd", 0x1a, DType::kBFloat16), 4);
  EXPECT_EQ(stage_rows("amd", 0x1a, DType::kFloat32), 8);
  EXPECT_EQ(stage_rows("amd", 0x19, DType::kBFloat16), 0);
  EXPECT_EQ(stage_rows("intel", 6, DType::kBFloat16), 0);
}

INSTANTIATE_TEST_SUITE_P(AllTiers, RaggedPagedAttentionTest,
                         ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16,
                                                              Isa::kAmx),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16)));

}  // namespace
}  // namespace tokamax
