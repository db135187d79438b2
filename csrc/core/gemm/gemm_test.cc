#include "csrc/core/gemm/gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "csrc/core/base/test_util.h"

namespace tokamax {
namespace {

using testing::Buffer;

struct GemmCase {
  int64_t m, k, n;
  bool transpose_a, transpose_b, pack_b;
  GemmBlocking blocking;
};

class GemmTest : public ::testing::TestWithParam<std::tuple<Isa, DType>> {};

void RunCase(Isa isa, DType dtype, const GemmCase& c) {
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  // Round random inputs through the dtype so the fp64 oracle sees exactly what the kernel sees.
  Buffer a(dtype, c.m * c.k, 1), b(dtype, c.k * c.n, 3);
  testing::FillRandom(a, c.m * c.k, 1);
  testing::FillRandom(b, c.k * c.n, 2);
  const ConstMatrix am = c.transpose_a ? ConstMatrix{a.data(), dtype, c.m, c.k, 1, c.m}
                                       : ConstMatrix{a.data(), dtype, c.m, c.k, c.k, 1};
  const ConstMatrix bm = c.transpose_b ? ConstMatrix{b.data(), dtype, c.k, c.n, 1, c.k}
                                       : ConstMatrix{b.data(), dtype, c.k, c.n, c.n, 1};
  Buffer got(dtype, c.m * c.n, 1), want(DType::kFloat32, c.m * c.n);
  testing::Poison(got, c.m * c.n);
  MutableMatrix gm{got.data(), dtype, c.m, c.n, c.n, 1};
  MutableMatrix wm{want.data(), DType::kFloat32, c.m, c.n, c.n, 1};
  GemmBlocking blocking = c.blocking;
  blocking.pack_b = c.pack_b;
  GemmRegion(GetGemmKernels(isa), am, bm, gm, 0, c.m, 0, c.n, blocking);
  ReferenceGemm(am, bm, wm);
  Buffer want_rounded(dtype, c.m * c.n);
  for (int64_t i = 0; i < c.m * c.n; ++i) want_rounded.Set(i, want.Get(i));
  EXPECT_LE(testing::RelativeError(got, want_rounded, c.m * c.n), testing::Tolerance(dtype))
      << "m=" << c.m << " k=" << c.k << " n=" << c.n << " ta=" << c.transpose_a
      << " tb=" << c.transpose_b << " pack_b=" << c.pack_b;
}

TEST_P(GemmTest, MatchesReferenceOnAwkwardShapes) {
  const auto [isa, dtype] = GetParam();
  const GemmBlocking small{12, 7, 32, true};   // forces every blocking loop to iterate
  const GemmBlocking large{144, 256, 512, true};
  for (const GemmCase& c : std::initializer_list<GemmCase>{
           {1, 1, 1, false, false, true, large},
           {5, 3, 17, false, false, true, small},
           {7, 19, 33, true, false, true, small},
           {13, 29, 15, false, true, true, small},
           {6, 16, 16, false, false, false, small},
           {11, 23, 47, false, false, false, small},
           {37, 70, 65, true, true, true, small},
           {64, 300, 100, false, false, true, large},
           {100, 513, 40, false, false, false, large},
       }) {
    RunCase(isa, dtype, c);
  }
}

// B a transposed view read in place by a region of at most kGemmDotMaxRows rows: the column-dot
// form. Every row count, depth tails, one column and column tails of each tile width; a row's
// bits are the same whatever rows share its region and whatever block_n and block_k (which
// the form ignores; packed, 7-deep slices would sum in another order) cut the product.
TEST_P(GemmTest, ColumnDotFormMatchesReferenceAndKeepsEachRowsBits) {
  const auto [isa, dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  for (int64_t m = 1; m <= kGemmDotMaxRows; ++m) {
    for (const auto& [k, n] : std::initializer_list<std::pair<int64_t, int64_t>>{{1, 1}, {17, 9}, {300, 43}}) {
      RunCase(isa, dtype, {m, k, n, false, true, false, {12, 7, 32, false}});
    }
  }
  const int64_t m = kGemmDotMaxRows, k = 83, n = 45;
  Buffer a(dtype, m * k), b(dtype, n * k);
  testing::FillRandom(a, m * k, 4);
  testing::FillRandom(b, n * k, 5);
  const ConstMatrix am{a.data(), dtype, m, k, k, 1}, bm{b.data(), dtype, k, n, 1, k};
  Buffer whole(dtype, m * n), single(dtype, m * n);
  testing::Poison(whole, m * n);
  testing::Poison(single, m * n);
  const GemmKernels& kernels = GetGemmKernels(isa);
  GemmRegion(kernels, am, bm, {whole.data(), dtype, m, n, n, 1}, 0, m, 0, n, {12, 256, 512, false});
  for (int64_t i = 0; i < m; ++i) {
    GemmRegion(kernels, am, bm, {single.data(), dtype, m, n, n, 1}, i, i + 1, 0, n, {12, 7, 16, false});
  }
  EXPECT_EQ(0, std::memcmp(whole.data(), single.data(), static_cast<size_t>(m * n * DTypeSize(dtype))));
}

// A few-row block on B read in place along its rows (GemmKernels::wide_f32 for fp32, the
// micro-kernel otherwise) keeps the bits of the packed product: 1 to 8 rows, 16-deep slices
// (accumulated), whole panels and a 4-wide tail. (fp32 products are inexact, so a changed order
// of sums shows; bf16 ones of these inputs may sum exactly.)
TEST_P(GemmTest, FewRowsInPlaceKeepThePackedBits) {
  const auto [isa, dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  if (dtype == DType::kBFloat16 && GetGemmKernels(isa).bf16) {
    GTEST_SKIP() << "packed bf16 runs on the tier's bf16 engine, another order of sums by design";
  }
  const int64_t k = 37, n = 100;
  for (int64_t m = 1; m <= 2 * kGemmWideRows; ++m) {
    Buffer a(dtype, m * k), b(dtype, k * n);
    testing::FillRandom(a, m * k, 6);
    testing::FillRandom(b, k * n, 7);
    const ConstMatrix am{a.data(), dtype, m, k, k, 1}, bm{b.data(), dtype, k, n, n, 1};
    Buffer packed(dtype, m * n), in_place(dtype, m * n);
    testing::Poison(packed, m * n);
    testing::Poison(in_place, m * n);
    const GemmKernels& kernels = GetGemmKernels(isa);
    GemmRegion(kernels, am, bm, {packed.data(), dtype, m, n, n, 1}, 0, m, 0, n, {12, 16, 512, true});
    GemmRegion(kernels, am, bm, {in_place.data(), dtype, m, n, n, 1}, 0, m, 0, n, {12, 16, 512, false});
    EXPECT_EQ(0, std::memcmp(packed.data(), in_place.data(), static_cast<size_t>(m * n * DTypeSize(dtype))))
        << "m=" << m;
  }
}

TEST_P(GemmTest, ZeroDepthWritesZeros) {
  const auto [isa, dtype] = GetParam();
  RunCase(isa, dtype, {9, 0, 21, false, false, true, {12, 8, 32, true}});
  RunCase(isa, dtype, {3, 0, 21, false, true, false, {12, 8, 32, false}});  // the column-dot form
}

TEST_P(GemmTest, SubRegionLeavesTheRestUntouched) {
  const auto [isa, dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const int64_t m = 20, k = 9, n = 40;
  Buffer a(dtype, m * k), b(dtype, k * n), c(dtype, m * n);
  testing::FillRandom(a, m * k, 3);
  testing::FillRandom(b, k * n, 4);
  testing::Poison(c, m * n);
  GemmRegion(GetGemmKernels(isa), {a.data(), dtype, m, k, k, 1}, {b.data(), dtype, k, n, n, 1},
             {c.data(), dtype, m, n, n, 1}, 3, 11, 5, 29, {6, 4, 16, true});
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const bool inside = i >= 3 && i < 11 && j >= 5 && j < 29;
      EXPECT_EQ(std::isnan(c.Get(i * n + j)), !inside) << i << "," << j;
    }
  }
}


// An A tile read in place (lda > mr, attention's transposed probabilities) gives bit for bit
// what the packed panel gives, and accumulate adds onto C.
class GemmMicroTest : public ::testing::TestWithParam<Isa> {};

TEST_P(GemmMicroTest, ReadsAInPlaceWithLda) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const GemmKernels& kernels = GetGemmKernels(isa);
  const int64_t mr = kernels.mr, nr = kernels.nr, depth = 37, lda = mr + 5;
  Buffer wide(DType::kFloat32, depth * lda), b(DType::kFloat32, depth * nr);
  testing::FillRandom(wide, depth * lda, 5);
  testing::FillRandom(b, depth * nr, 6);
  const float* a_in_place = static_cast<const float*>(wide.data());
  std::vector<float> packed(depth * mr);
  for (int64_t p = 0; p < depth; ++p) {
    for (int64_t i = 0; i < mr; ++i) packed[p * mr + i] = a_in_place[p * lda + i];
  }
  const float* bp = static_cast<const float*>(b.data());
  std::vector<float> want(mr * nr, 0.5f), got(mr * nr, 0.5f);
  kernels.micro_f32(mr, depth, packed.data(), mr, bp, nr, want.data(), nr, /*accumulate=*/true);
  kernels.micro_f32(mr, depth, a_in_place, lda, bp, nr, got.data(), nr, /*accumulate=*/true);
  EXPECT_EQ(got, want);
  double max_error = 0.0;
  for (int64_t i = 0; i < mr; ++i) {
    for (int64_t j = 0; j < nr; ++j) {
      double dot = 0.5;
      for (int64_t p = 0; p < depth; ++p) dot += double{a_in_place[p * lda + i]} * double{bp[p * nr + j]};
      max_error = std::max(max_error, std::abs(dot - got[i * nr + j]));
    }
  }
  EXPECT_LT(max_error, 1e-4);
}

// A short tile (rows < mr: a region's last rows, on a narrower kernel where the tier has one)
// and both FmaBroadcastForms give each row the bits of the full tile in the embedded form, for
// fp32, bf16 and fp16 B, packed (ldb = nr) and in place (a wider ldb), fresh and accumulated.
TEST_P(GemmMicroTest, ShortTilesAndBothBroadcastFormsKeepTheBits) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const GemmKernels& base = GetGemmKernels(isa, FmaBroadcastForm::kEmbedded);
  const int64_t mr = base.mr, nr = base.nr, depth = 45;
  Buffer a(DType::kFloat32, depth * mr);
  testing::FillRandom(a, depth * mr, 11);
  const float* ap = static_cast<const float*>(a.data());
  for (DType b_dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int64_t ldb : {nr, nr + 48}) {
      Buffer b(b_dtype, depth * ldb);
      testing::FillRandom(b, depth * ldb, 12);
      auto run = [&](const GemmKernels& k, int64_t rows, bool accumulate) {
        std::vector<float> c(mr * nr, 0.25f);
        for (int64_t i = 0; i < mr * nr; ++i) c[i] += 0.01f * static_cast<float>(i % 7);
        if (b_dtype == DType::kFloat32) {
          k.micro_f32(rows, depth, ap, mr, static_cast<const float*>(b.data()), ldb, c.data(), nr, accumulate);
        } else if (b_dtype == DType::kBFloat16) {
          k.micro_bf16(rows, depth, ap, mr, static_cast<const uint16_t*>(b.data()), ldb, c.data(), nr, accumulate);
        } else {
          k.micro_f16(rows, depth, ap, mr, static_cast<const uint16_t*>(b.data()), ldb, c.data(), nr, accumulate);
        }
        return c;
      };
      for (bool accumulate : {false, true}) {
        const std::vector<float> want = run(base, mr, accumulate);
        for (FmaBroadcastForm form : {FmaBroadcastForm::kEmbedded, FmaBroadcastForm::kRegister}) {
          for (int64_t rows = 1; rows <= mr; ++rows) {
            const std::vector<float> got = run(GetGemmKernels(isa, form), rows, accumulate);
            for (int64_t i = 0; i < rows * nr; ++i) {
              ASSERT_EQ(got[i], want[i]) << DTypeName(b_dtype) << " ldb " << ldb << " rows " << rows << " form "
                                         << static_cast<int>(form) << " accumulate " << accumulate << " at " << i;
            }
          }
        }
      }
    }
  }
}

// The broadcast form follows the FMA datapath: kRegister where 512-bit FMAs are full width
// (Intel, AMD Zen 5 = family 0x1a and later), kEmbedded on Zen 4's split datapath and elsewhere.
TEST(GemmFormTest, PreferredFormFollowsTheFmaDatapath) {
  const auto form_of = [](const char* vendor, int family) {
    CpuInfo cpu;
    cpu.vendor = vendor;
    cpu.family = family;
    return PreferredFmaBroadcastForm(cpu);
  };
  EXPECT_EQ(form_of("intel", 6), FmaBroadcastForm::kRegister);
  EXPECT_EQ(form_of("amd", 0x1a), FmaBroadcastForm::kRegister);
  EXPECT_EQ(form_of("amd", 0x19), FmaBroadcastForm::kEmbedded);
  EXPECT_EQ(form_of("amd", 0x17), FmaBroadcastForm::kEmbedded);
  EXPECT_EQ(form_of("unknown", 0), FmaBroadcastForm::kEmbedded);
}

// The in-place blocking of the classes it was measured on: a few rows stream 32-deep slices of
// 1024 columns (Zen 4's vdpbf16ps bf16 kept 256); 13-95 rows 512 columns, 64 deep on Intel fp32.
TEST(GemmBlockingTest, InPlaceBlockingFollowsTheMeasuredClasses) {
  const auto blocking_of = [](const char* vendor, int family, bool bf16_dot, bool amx, int64_t rows, DType dtype) {
    CpuInfo cpu;
    cpu.vendor = vendor;
    cpu.family = family;
    cpu.avx512bf16 = bf16_dot;
    cpu.amx_tile = cpu.amx_bf16 = amx;
    const StreamingBlocking b = InPlaceBlocking(rows, dtype, cpu);
    return std::make_pair(b.block_k, b.block_n);
  };
  using P = std::pair<int64_t, int64_t>;
  EXPECT_EQ(blocking_of("amd", 0x1a, true, false, 4, DType::kBFloat16), P(32, 1024));
  EXPECT_EQ(blocking_of("amd", 0x19, true, false, 4, DType::kBFloat16), P(256, 1024));
  EXPECT_EQ(blocking_of("amd", 0x19, true, false, 4, DType::kFloat32), P(32, 1024));
  EXPECT_EQ(blocking_of("intel", 6, true, true, 12, DType::kBFloat16), P(32, 1024));
  EXPECT_EQ(blocking_of("intel", 6, true, true, 48, DType::kFloat32), P(64, 512));
  EXPECT_EQ(blocking_of("intel", 6, true, true, 48, DType::kBFloat16), P(128, 512));
  EXPECT_EQ(blocking_of("amd", 0x1a, true, false, 48, DType::kFloat32), P(128, 512));
}

// pack_a of a row-major A (the register-transpose paths, rows gathered through a map or not)
// and of its transposed view (the strided path), in fp32, bf16 and fp16: every panel element is
// A's, zero past the last row, nothing written past the panels, for depths around the 8- and
// 16-step blocks and row counts around whole panels.
TEST_P(GemmMicroTest, PackAMatchesElementwise) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const GemmKernels& kernels = GetGemmKernels(isa);
  const int64_t mr = kernels.mr, ld = 83;
  std::vector<int64_t> row_map(ld);
  for (int64_t i = 0; i < ld; ++i) row_map[i] = (i * 37 + 5) % ld;  // a permutation
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    Buffer source(dtype, ld * ld);  // square, so both views hold every index used
    testing::FillRandom(source, ld * ld, 7);
    for (int layout = 0; layout < 3; ++layout) {  // row-major, gathered row-major, transposed
      const bool transposed = layout == 2;
      const int64_t* map = layout == 1 ? row_map.data() : nullptr;
      for (int64_t rows : {int64_t{1}, mr - 1, mr, 2 * mr + 3}) {
        for (int64_t depth : {1, 7, 8, 9, 16, 21, 40}) {
          const int64_t row0 = 2, k0 = 3, panels = (rows + mr - 1) / mr, size = panels * mr * depth;
          // A(i, p) at data[i * ld + p], or for the transposed view at data[p * ld + i].
          const ConstMatrix a = transposed ? ConstMatrix{source.data(), dtype, ld, ld, 1, ld}
                                           : ConstMatrix{source.data(), dtype, ld, ld, ld, 1};
          std::vector<float> got(size + 16, -7.0f);
          kernels.pack_a(a, row0, rows, k0, depth, map, got.data());
          for (int64_t r = 0; r < panels * mr; ++r) {
            for (int64_t p = 0; p < depth; ++p) {
              const int64_t i = map != nullptr ? map[row0 + r < ld ? row0 + r : 0] : row0 + r, j = k0 + p;
              const float want = r < rows ? source.Get(transposed ? j * ld + i : i * ld + j) : 0.0f;
              ASSERT_EQ(got[(r / mr) * mr * depth + p * mr + r % mr], want)
                  << DTypeName(dtype) << " layout " << layout << " rows " << rows << " depth " << depth << " r " << r
                  << " p " << p;
            }
          }
          for (int64_t e = size; e < size + 16; ++e) ASSERT_EQ(got[e], -7.0f) << "wrote past the panels";
        }
      }
    }
  }
}

// pack_b of a row-major B (the row walk) and of its transposed view (whole panels by the
// register transposes, a last partial panel element-wise), in fp32, bf16 and fp16: every panel
// element is B's, zero past the last column, nothing written past the panels.
TEST_P(GemmMicroTest, PackBMatchesElementwise) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const GemmKernels& kernels = GetGemmKernels(isa);
  const int64_t nr = kernels.nr, ld = 83;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    Buffer source(dtype, ld * ld);
    testing::FillRandom(source, ld * ld, 8);
    for (bool transposed : {false, true}) {
      for (int64_t cols : {int64_t{1}, nr - 1, nr, 2 * nr + 3}) {
        for (int64_t depth : {1, 7, 8, 9, 16, 21, 40}) {
          const int64_t col0 = 2, k0 = 3, panels = (cols + nr - 1) / nr, size = panels * nr * depth;
          // B(p, j) at data[p * ld + j], or for the transposed view at data[j * ld + p].
          const ConstMatrix b = transposed ? ConstMatrix{source.data(), dtype, ld, ld, 1, ld}
                                           : ConstMatrix{source.data(), dtype, ld, ld, ld, 1};
          std::vector<float> got(size + 16, -7.0f);
          kernels.pack_b(b, k0, depth, col0, cols, got.data());
          for (int64_t c = 0; c < panels * nr; ++c) {
            for (int64_t p = 0; p < depth; ++p) {
              const int64_t i = k0 + p, j = col0 + c;
              const float want = c < cols ? source.Get(transposed ? j * ld + i : i * ld + j) : 0.0f;
              ASSERT_EQ(got[(c / nr) * nr * depth + p * nr + c % nr], want)
                  << DTypeName(dtype) << " transposed " << transposed << " cols " << cols << " depth " << depth
                  << " c " << c << " p " << p;
            }
          }
          for (int64_t e = size; e < size + 16; ++e) ASSERT_EQ(got[e], -7.0f) << "wrote past the panels";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTiers, GemmMicroTest, ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const auto& info) { return std::string(IsaName(info.param)); });
INSTANTIATE_TEST_SUITE_P(
    AllTiers, GemmTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16)),
    [](const auto& info) {
      return std::string(IsaName(std::get<0>(info.param))) + "_" + DTypeName(std::get<1>(info.param));
    });

TEST(DTypeTest, HalfRoundTripIsExactForEveryHalf) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t half = static_cast<uint16_t>(bits);
    const float value = HalfToFloat(half);
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(value))));
    } else {
      EXPECT_EQ(FloatToHalf(value), half) << bits;
    }
  }
}

TEST(DTypeTest, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);                       // overflows to inf
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(5.9604645e-08f), 0x0001);                  // smallest subnormal
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
}

TEST(IsaTest, EnvironmentForcesTier) {
  Isa isa;
  setenv("TOKAMAX_CPU_ISA", "scalar", 1);
  ASSERT_TRUE(ActiveIsa(&isa).ok());
  EXPECT_EQ(isa, Isa::kScalar);
  setenv("TOKAMAX_CPU_ISA", "sse9", 1);
  const Status bad = ActiveIsa(&isa);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("sse9"), std::string::npos);
  unsetenv("TOKAMAX_CPU_ISA");
  ASSERT_TRUE(ActiveIsa(&isa).ok());
  EXPECT_EQ(isa, BestIsa(GetCpuInfo()));
}

TEST(IsaTest, TiersNotBuiltAreNeverSupported) {
  // x86-64 builds every tier; other processors the scalar one only.
#if defined(__x86_64__)
  const bool x86 = true;
#else
  const bool x86 = false;
#endif
  CpuInfo everything;
  everything.avx2 = everything.fma = everything.f16c = everything.avx512f = true;
  everything.avx512bw = everything.avx512vl = everything.avx512bf16 = true;
  everything.amx_tile = everything.amx_bf16 = true;
  EXPECT_TRUE(IsaBuilt(Isa::kScalar));
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx}) {
    EXPECT_EQ(IsaBuilt(isa), x86) << IsaName(isa);
    if (!IsaBuilt(isa)) {
      EXPECT_FALSE(IsaSupported(isa, everything)) << IsaName(isa);
      setenv("TOKAMAX_CPU_ISA", IsaName(isa), 1);
      Isa active = Isa::kScalar;
      const Status status = ActiveIsa(&active);
      EXPECT_FALSE(status.ok());
      EXPECT_NE(status.message().find("no such tier"), std::string::npos) << status.message();
    }
  }
  unsetenv("TOKAMAX_CPU_ISA");
  if (!x86) {
    EXPECT_EQ(BestIsa(everything), Isa::kScalar);
  }
}

}  // namespace
}  // namespace tokamax

namespace tokamax {
namespace {

CpuInfo Cpu(const char* vendor, int family, int model, bool avx512 = false) {
  CpuInfo info;
  info.vendor = vendor;
  info.family = family;
  info.model = model;
  info.avx512f = avx512;
  return info;
}

TEST(CpuInfoTest, MicroarchitectureNamesAreNormalised) {
  EXPECT_EQ(MicroarchitectureName(Cpu("amd", 0x19, 0x01)), "zen3");   // EPYC Milan
  EXPECT_EQ(MicroarchitectureName(Cpu("amd", 0x19, 0x21)), "zen3");   // Ryzen 5000
  EXPECT_EQ(MicroarchitectureName(Cpu("amd", 0x19, 0x11)), "zen4");   // EPYC Genoa
  EXPECT_EQ(MicroarchitectureName(Cpu("amd", 0x17, 0x31)), "zen2");
  EXPECT_EQ(MicroarchitectureName(Cpu("amd", 0x1a, 0x02)), "zen5");
  EXPECT_EQ(MicroarchitectureName(Cpu("intel", 6, 0x8f)), "sapphirerapids");
  EXPECT_EQ(MicroarchitectureName(Cpu("intel", 6, 0x55, true)), "skylakex");
  EXPECT_EQ(MicroarchitectureName(Cpu("intel", 6, 0x55, false)), "skylake");
  EXPECT_EQ(MicroarchitectureName(Cpu("intel", 6, 0xa7)), "model167");  // unknown: stable, not a guess
  EXPECT_EQ(MicroarchitectureName(Cpu("arm", 0, 0)), "aarch64");
  EXPECT_EQ(MicroarchitectureName(Cpu("unknown", 0, 0)), "unknown");
  for (const char* vendor : {"amd", "intel"}) {
    for (int family : {6, 0x17, 0x19, 0x1a}) {
      for (int model = 0; model < 256; model += 7) {
        const std::string name = MicroarchitectureName(Cpu(vendor, family, model));
        for (char c : name) EXPECT_TRUE((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) << name;
      }
    }
  }
}

}  // namespace
}  // namespace tokamax
