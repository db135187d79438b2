#include "csrc/core/gemm/bf16_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "csrc/core/base/dtype.h"
#include "csrc/core/runtime/isa.h"
#include "csrc/core/softmax/softmax_kernels.h"

namespace tokamax {
namespace {

// The packers need AVX-512 BW/BF16: the avx512bf16 tier (the amx tier implies it).
bool PackersHere() { return IsaSupported(Isa::kAvx512Bf16, GetCpuInfo()); }

// bf16 values with few mantissa bits, so every product and every fp32 sum of them is exact and
// the kernel must match the float64 oracle bit for bit.
std::vector<uint16_t> SmallBf16(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-8, 8);
  std::vector<uint16_t> x(count);
  for (auto& v : x) v = FloatToBFloat16(dist(rng) * 0.125f);
  return x;
}

// B(p, j) of a VNNI-packed operand (the layout bf16_gemm.h documents).
float VnniAt(const std::vector<uint16_t>& b, int64_t depth, int64_t p, int64_t j) {
  return BFloat16ToFloat(b[(j / 16) * depth * 16 + (p / 2) * 32 + (j % 16) * 2 + p % 2]);
}

// Each tier's bf16 product engine: the tile unit (amx) and the dot instruction (avx512bf16).
class Bf16EngineTest : public ::testing::TestWithParam<Isa> {};

TEST_P(Bf16EngineTest, MatchesFloat64OracleExactly) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const Bf16Products engine = GetBf16Products(isa);
  ASSERT_TRUE(engine);
  const Bf16ProductScope scope(engine);
  struct Case { int64_t m, n, depth, lda; bool accumulate; float scale; };
  for (const Case& c : {Case{16, 16, 32, 32, false, 1.0f}, Case{48, 80, 96, 100, false, 0.5f},
                        Case{32, 48, 64, 64, true, 1.0f}, Case{80, 32, 160, 168, true, 1.0f},
                        Case{16, 64, 32, 40, false, 0.25f},
                        // Skinny shapes take the amx 4-long strips, then the blocks for the rest;
                        // widths of 1, 2, 3, 5 and 9 panels take every dot block (48, 32, 16 wide).
                        Case{16, 48, 32, 32, false, 0.5f}, Case{32, 144, 64, 70, true, 1.0f},
                        Case{16, 144, 64, 64, true, 1.0f}, Case{16, 80, 96, 96, false, 0.5f},
                        Case{144, 16, 64, 72, false, 0.5f}, Case{128, 16, 32, 32, true, 1.0f}}) {
    const std::vector<uint16_t> a = SmallBf16(c.m * c.lda, 1);
    // Pack B from a row-major fp32 matrix, then multiply.
    std::vector<float> b_rows(c.depth * c.n);
    const std::vector<uint16_t> b_bits = SmallBf16(c.depth * c.n, 2);
    for (int64_t i = 0; i < c.depth * c.n; ++i) b_rows[i] = BFloat16ToFloat(b_bits[i]);
    std::vector<uint16_t> b(c.depth * c.n);
    PackVnniFromRows(b_rows.data(), c.n, c.depth, c.depth, c.n, b.data());
    const int64_t ldc = c.n + 16;
    std::vector<float> got(c.m * ldc, 7.0f);
    engine.gemm(c.m, c.n, c.depth, a.data(), c.lda, b.data(), got.data(), ldc, c.accumulate, c.scale);
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t j = 0; j < ldc; ++j) {
        double want = 7.0;
        if (j < c.n) {
          double dot = 0.0;
          for (int64_t p = 0; p < c.depth; ++p) dot += double(BFloat16ToFloat(a[i * c.lda + p])) * b_rows[p * c.n + j];
          want = c.accumulate ? 7.0 + dot : c.scale * dot;
        }
        ASSERT_EQ(got[i * ldc + j], static_cast<float>(want)) << "m=" << c.m << " n=" << c.n << " i=" << i << " j=" << j;
      }
    }
  }
}

TEST(Bf16PackTest, PackersRoundAndZeroPad) {
  if (!PackersHere()) GTEST_SKIP() << "avx512bf16 not supported here";
  // 5 rows of 32 columns (ld 40) packed 32 deep: rows past 5 are zero, values rounded to
  // nearest even exactly like FloatToBFloat16.
  std::mt19937 rng(3);
  std::normal_distribution<float> dist;
  std::vector<float> x(5 * 40);
  for (auto& v : x) v = dist(rng);
  std::vector<uint16_t> from_rows(32 * 32, 0xffff);
  PackVnniFromRows(x.data(), 40, 5, 32, 32, from_rows.data());
  for (int64_t p = 0; p < 32; ++p) {
    for (int64_t j = 0; j < 32; ++j) {
      const float want = p < 5 ? BFloat16ToFloat(FloatToBFloat16(x[p * 40 + j])) : 0.0f;
      ASSERT_EQ(VnniAt(from_rows, 32, p, j), want) << p << " " << j;
    }
  }
  // Xᵀ from 16 vector pointers: 5 columns of B (rows of x as bf16, read with step 2 and as is),
  // 24 valid depth steps, the rest and the null vectors zero.
  std::vector<uint16_t> bits(5 * 80);
  for (int64_t i = 0; i < 5 * 80; ++i) bits[i] = FloatToBFloat16(x[(i / 80) * 40 + (i % 80) / 2]);
  for (int64_t step : {1, 2}) {
    const uint16_t* vectors[16] = {};
    for (int64_t j = 0; j < 5; ++j) vectors[j] = bits.data() + j * 80;
    std::vector<uint16_t> from_vectors(32 * 16, 0xffff);
    std::vector<uint16_t> block(16 * 32);
    PackVnniFromBf16Vectors(vectors, step, 24, 32, from_vectors.data(), block.data());
    for (int64_t p = 0; p < 32; ++p) {
      for (int64_t j = 0; j < 16; ++j) {
        const float want = j < 5 && p < 24 ? BFloat16ToFloat(bits[j * 80 + p * step]) : 0.0f;
        ASSERT_EQ(VnniAt(from_vectors, 32, p, j), want) << step << " " << p << " " << j;
      }
    }
  }
}

TEST(Bf16PackTest, StridedCopiesAndTransposesAreExact) {
  if (!PackersHere()) GTEST_SKIP() << "avx512bf16 not supported here";
  // A 37 x 21 view of a 3000-element buffer: row-major, column-major (a transposed view) and fully
  // strided, each copied as it is and transposed.
  const std::vector<uint16_t> x = SmallBf16(50 * 60, 7);
  struct View { int64_t row_stride, col_stride; };
  for (const View& v : {View{60, 1}, View{1, 50}, View{80, 2}}) {
    for (bool transpose : {false, true}) {
      std::vector<uint16_t> got(40 * 64, 0x7777);
      CopyBf16(x.data(), v.row_stride, v.col_stride, 37, 21, transpose, got.data(), 64);
      for (int64_t i = 0; i < 37; ++i) {
        for (int64_t j = 0; j < 21; ++j) {
          const uint16_t want = x[i * v.row_stride + j * v.col_stride];
          ASSERT_EQ(transpose ? got[j * 64 + i] : got[i * 64 + j], want)
              << v.row_stride << "," << v.col_stride << " t=" << transpose << " " << i << " " << j;
        }
      }
    }
  }
}

TEST(Bf16PackTest, Bf16RowPackAndTransposeAreExact) {
  if (!PackersHere()) GTEST_SKIP() << "avx512bf16 not supported here";
  // 37 rows of 48 columns (ld 50): VNNI panels 64 deep, and the transpose of every shape tail.
  const std::vector<uint16_t> x = SmallBf16(37 * 50, 4);
  std::vector<uint16_t> packed(64 * 48, 0xffff);
  for (int64_t p = 0; p < 64; p += 2) {
    PackVnniPair(p < 37 ? &x[p * 50] : nullptr, p + 1 < 37 ? &x[(p + 1) * 50] : nullptr, p, 64, 48, packed.data());
  }
  for (int64_t p = 0; p < 64; ++p) {
    for (int64_t j = 0; j < 48; ++j) {
      ASSERT_EQ(VnniAt(packed, 64, p, j), p < 37 ? BFloat16ToFloat(x[p * 50 + j]) : 0.0f) << p << " " << j;
    }
  }
  // The same panels packed panel by panel: two at a time, then a single last one (n = 48, 16).
  for (int64_t n : {48, 32, 16}) {
    std::vector<uint16_t> rows_packed(64 * n, 0xffff);
    PackVnniFromBf16Rows(x.data(), 50, 37, 64, n, rows_packed.data());
    for (int64_t p = 0; p < 64; ++p) {
      for (int64_t j = 0; j < n; ++j) {
        ASSERT_EQ(VnniAt(rows_packed, 64, p, j), p < 37 ? BFloat16ToFloat(x[p * 50 + j]) : 0.0f)
            << n << " " << p << " " << j;
      }
    }
  }
  // A panel from 16 contiguous rows, depth 40: two 8-pair register blocks and a 4-pair tail.
  const std::vector<uint16_t> block = SmallBf16(16 * 40, 5);
  std::vector<uint16_t> panel(40 * 16, 0xffff);
  PackVnniFromBf16Block(block.data(), 40, panel.data());
  for (int64_t p = 0; p < 40; ++p) {
    for (int64_t j = 0; j < 16; ++j) ASSERT_EQ(VnniAt(panel, 40, p, j), BFloat16ToFloat(block[j * 40 + p])) << p << " " << j;
  }
  for (int64_t rows : {37, 32, 16, 5}) {
    for (int64_t cols : {48, 13, 8}) {
      std::vector<uint16_t> t(cols * 40, 0x7777);
      TransposeBf16(x.data(), 50, rows, cols, t.data(), 40);
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t r = 0; r < 40; ++r) {
          ASSERT_EQ(t[c * 40 + r], r < rows ? x[r * 50 + c] : 0x7777) << rows << "x" << cols << " " << r << " " << c;
        }
      }
    }
  }
}

TEST(Bf16PackTest, ExpPackEqualsExpThenPackBitwise) {
  if (!PackersHere()) GTEST_SKIP() << "avx512bf16 not supported here";
  // 45 rows of 48 columns (ld 56), masked entries included, packed 64 deep.
  std::mt19937 rng(6);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> x(45 * 56);
  for (auto& v : x) v = dist(rng);
  for (size_t i = 0; i < x.size(); i += 7) x[i] = -std::numeric_limits<float>::infinity();
  std::vector<float> sub(48), sums_fused(48, 0.5f), sums_two_pass(48, 0.5f);
  for (auto& v : sub) v = dist(rng);
  std::vector<uint16_t> fused(64 * 48), two_pass(64 * 48);
  ExpPackVnni(x.data(), 56, 45, 64, 48, sub.data(), sums_fused.data(), fused.data());
  std::vector<float> e = x;
  GetSoftmaxKernels(Isa::kAvx512).exp_columns(e.data(), 45, 56, 48, sub.data(), sums_two_pass.data());
  PackVnniFromRows(e.data(), 56, 45, 64, 48, two_pass.data());
  EXPECT_EQ(fused, two_pass);
  EXPECT_EQ(sums_fused, sums_two_pass);
  // x itself is left as it was (regenerated from the same seed).
  std::vector<float> x_again(45 * 56);
  std::mt19937 rng_again(6);
  std::normal_distribution<float> dist_again(0.0f, 3.0f);
  for (auto& v : x_again) v = dist_again(rng_again);
  for (size_t i = 0; i < x_again.size(); i += 7) x_again[i] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(x, x_again);
}

INSTANTIATE_TEST_SUITE_P(Engines, Bf16EngineTest, ::testing::Values(Isa::kAvx512Bf16, Isa::kAmx),
                         [](const auto& info) { return std::string(IsaName(info.param)); });

TEST(Bf16EngineTierTest, TiersAreReportedConsistently) {
  const CpuInfo& info = GetCpuInfo();
  // amx implies avx512bf16, which implies avx512 and the CPU's AVX-512 BW/VL/BF16 bits; the
  // best tier is the highest supported one.
  if (IsaSupported(Isa::kAmx, info)) {
    EXPECT_TRUE(IsaSupported(Isa::kAvx512Bf16, info));
    EXPECT_TRUE(info.amx_tile && info.amx_bf16);
    EXPECT_EQ(BestIsa(info), Isa::kAmx);
  } else if (IsaSupported(Isa::kAvx512Bf16, info)) {
    EXPECT_TRUE(IsaSupported(Isa::kAvx512, info));
    EXPECT_TRUE(info.avx512bw && info.avx512vl && info.avx512bf16);
    EXPECT_EQ(BestIsa(info), Isa::kAvx512Bf16);
  } else {
    EXPECT_NE(BestIsa(info), Isa::kAmx);
    EXPECT_NE(BestIsa(info), Isa::kAvx512Bf16);
  }
  EXPECT_STREQ(IsaName(Isa::kAvx512Bf16), "avx512bf16");
  EXPECT_STREQ(IsaName(Isa::kAmx), "amx");
  // Tiers without an engine, or not built here (IsaBuilt), have none; the amx engine alone
  // needs the tile scope.
  EXPECT_FALSE(GetBf16Products(Isa::kAvx512));
  EXPECT_FALSE(GetBf16Products(Isa::kScalar));
  EXPECT_EQ(GetBf16Products(Isa::kAmx).tile_unit, IsaBuilt(Isa::kAmx));
  EXPECT_EQ(static_cast<bool>(GetBf16Products(Isa::kAvx512Bf16)), IsaBuilt(Isa::kAvx512Bf16));
  EXPECT_FALSE(GetBf16Products(Isa::kAvx512Bf16).tile_unit);
}

}  // namespace
}  // namespace tokamax
