#include "csrc/core/gemm/gemm_tiles.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/base/int_math.h"
#include "csrc/core/base/test_util.h"

namespace tokamax {
namespace {

using testing::Buffer;

class GemmTilesTest : public ::testing::TestWithParam<Isa> {};

// x as a [2, rows, 3, cols] view of `dtype` over a buffer laid out [2, 3, rows, cols] (so dim 1
// is not the outer one, as attention's head-major KV caches are).
StridedView<4> HeadMajorView(const Buffer& buffer, DType dtype, int64_t rows, int64_t cols) {
  StridedView<4> x;
  x.data = buffer.data();
  x.dtype = dtype;
  const int64_t sizes[4] = {2, rows, 3, cols}, strides[4] = {3 * rows * cols, cols, rows * cols, 1};
  std::memcpy(x.sizes, sizes, sizeof(sizes));
  std::memcpy(x.strides, strides, sizeof(strides));
  return x;
}

// Every tile of every matrix of x times a random B (A = the tile, as PackedMatrixTiles packs it):
// the float64 product within fp32 rounding, and the same bits whether the tiles were packed at
// construction or on demand.
TEST_P(GemmTilesTest, PackedTilesAsAMatchTheOracleAndPackingOnDemand) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const GemmKernels& gemm = GetGemmKernels(isa);
  const int64_t rows = 37, cols = 24, block = 16, n = 2 * gemm.nr;
  Buffer xb(DType::kFloat32, 2 * 3 * rows * cols);
  testing::FillRandom(xb, 2 * 3 * rows * cols, 1);
  const StridedView<4> x = HeadMajorView(xb, DType::kFloat32, rows, cols);
  Buffer bb(DType::kFloat32, cols * n);
  testing::FillRandom(bb, cols * n, 2);
  std::vector<float> b_panels(cols * n);
  gemm.pack_b({bb.data(), DType::kFloat32, cols, n, n, 1}, 0, cols, 0, n, b_panels.data());
  const PackedMatrixTiles all(gemm, x, block, /*as_a=*/true, /*pack_all=*/true);
  const PackedMatrixTiles each(gemm, x, block, /*as_a=*/true, /*pack_all=*/false);
  std::vector<float> scratch(each.tile_floats());
  const int64_t ldc = n, c_rows = RoundUp(block, gemm.mr);
  for (int64_t i0 = 0; i0 < 2; ++i0) {
    for (int64_t i2 = 0; i2 < 3; ++i2) {
      for (int64_t row0 = 0; row0 < rows; row0 += block) {
        const int64_t tile_rows = std::min(block, rows - row0), panels = CeilDiv(tile_rows, gemm.mr);
        std::vector<float> c_all(c_rows * ldc, NAN), c_each(c_rows * ldc, NAN);
        TileGemm(gemm, cols, all.Tile(i0, i2, row0, tile_rows, nullptr), panels,
                 PackedB(b_panels.data(), cols, gemm.nr), n / gemm.nr, c_all.data(), ldc, false);
        TileGemm(gemm, cols, each.Tile(i0, i2, row0, tile_rows, scratch.data()), panels,
                 PackedB(b_panels.data(), cols, gemm.nr), n / gemm.nr, c_each.data(), ldc, false);
        for (int64_t i = 0; i < tile_rows; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double want = 0.0;
            for (int64_t p = 0; p < cols; ++p) {
              want += double(xb.Get(x.Offset(i0, row0 + i, i2, p))) * bb.Get(p * n + j);
            }
            ASSERT_NEAR(c_all[i * ldc + j], want, 1e-4 * cols) << i0 << " " << i2 << " " << row0 + i << " " << j;
            ASSERT_EQ(std::memcmp(&c_all[i * ldc + j], &c_each[i * ldc + j], sizeof(float)), 0);
          }
        }
      }
    }
  }
}

// An fp32 tile read in place as A gives the same bits as the same tile packed; tiles as B
// (depth = the tile's rows) match the oracle, packed at construction or on demand.
TEST_P(GemmTilesTest, InPlaceAEqualsPackedAAndTilesAsBMatchTheOracle) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const GemmKernels& gemm = GetGemmKernels(isa);
  const int64_t mr = gemm.mr, nr = gemm.nr, depth = 21, rows = 2 * mr, ld = rows + 5, cols = 2 * nr;
  // st[p][i]: rows i of A at depth p, ld apart, with one spare zero row for the whole-panel reads.
  Buffer st(DType::kFloat32, (depth + 1) * ld);
  testing::FillRandom(st, depth * ld, 3);
  for (int64_t i = depth * ld; i < (depth + 1) * ld; ++i) st.Set(i, 0.0f);
  const float* st_data = static_cast<const float*>(st.data());
  std::vector<float> a_panels(rows * depth);
  gemm.pack_a({st_data, DType::kFloat32, rows, depth, 1, ld}, 0, rows, 0, depth, nullptr, a_panels.data());
  // B: matrix (1, 2) of a [2, depth, 3, cols] view, its rows [0, depth) as one tile.
  Buffer xb(DType::kFloat32, 2 * 3 * depth * cols);
  testing::FillRandom(xb, 2 * 3 * depth * cols, 4);
  const StridedView<4> x = HeadMajorView(xb, DType::kFloat32, depth, cols);
  for (const bool pack_all : {true, false}) {
    const PackedMatrixTiles tiles(gemm, x, depth, /*as_a=*/false, pack_all);
    std::vector<float> scratch(tiles.tile_floats());
    const Panels b = tiles.Tile(1, 2, 0, depth, scratch.data());
    std::vector<float> in_place(rows * cols, NAN), packed(rows * cols, NAN);
    TileGemm(gemm, depth, InPlaceA(st_data, ld, mr), rows / mr, b, cols / nr, in_place.data(), cols, false);
    TileGemm(gemm, depth, PackedA(a_panels.data(), depth, mr), rows / mr, b, cols / nr, packed.data(), cols, false);
    ASSERT_EQ(std::memcmp(in_place.data(), packed.data(), sizeof(float) * rows * cols), 0);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        double want = 0.0;
        for (int64_t p = 0; p < depth; ++p) want += double(st.Get(p * ld + i)) * xb.Get(x.Offset(1, p, 2, j));
        ASSERT_NEAR(packed[i * cols + j], want, 1e-4 * depth) << "pack_all=" << pack_all;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Tiers, GemmTilesTest, ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) { return std::string(IsaName(info.param)); });

// Both copy layouts hold x's bf16 elements exactly where At() says and zeros in the padding.
TEST(Bf16MatrixCopyTest, RowsAndTransposedLayoutsAreExactAndZeroPadded) {
  if (!IsaSupported(Isa::kAvx512Bf16, GetCpuInfo())) GTEST_SKIP() << "avx512bf16 not supported here";
  const int64_t rows = 21, cols = 32;
  Buffer xb(DType::kBFloat16, 2 * 3 * rows * cols);
  testing::FillRandom(xb, 2 * 3 * rows * cols, 5);
  const StridedView<4> x = HeadMajorView(xb, DType::kBFloat16, rows, cols);
  const Bf16MatrixCopy by_rows(x, Bf16MatrixCopy::kRows), transposed(x, Bf16MatrixCopy::kTransposed);
  const uint16_t* bits = static_cast<const uint16_t*>(xb.data());
  for (int64_t i0 = 0; i0 < 2; ++i0) {
    for (int64_t i2 = 0; i2 < 3; ++i2) {
      const uint16_t* r = by_rows.At(i0, i2, 0);
      const uint16_t* t = transposed.At(i0, i2, 0);
      for (int64_t i = 0; i < RoundUp(rows + kBf16TileRows, kBf16TileRows); ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          const uint16_t want = i < rows ? bits[x.Offset(i0, i, i2, j)] : 0;
          ASSERT_EQ(r[i * by_rows.ld() + j], want) << i << " " << j;
          ASSERT_EQ(t[j * transposed.ld() + i], want) << i << " " << j;
        }
      }
      // A tile read 32 rows deep from the last row start stays in the zero padding.
      for (int64_t j = 0; j < cols; ++j) {
        for (int64_t i = rows; i < rows + 2 * kBf16TileRows; ++i) ASSERT_EQ(t[j * transposed.ld() + i], 0);
      }
      EXPECT_EQ(by_rows.At(i0, i2, 8), r + 8 * by_rows.ld());
      EXPECT_EQ(transposed.At(i0, i2, 8), t + 8);
    }
  }
}

TEST(StridedViewTest, OffsetsAddressesAndTilingHelpers) {
  float storage[64] = {};
  MutableStridedView<3> view;
  view.data = storage;
  view.dtype = DType::kFloat32;
  const int64_t strides[3] = {16, 1, 4};
  std::memcpy(view.strides, strides, sizeof(strides));
  EXPECT_EQ(view.Offset(2, 3, 1), 2 * 16 + 3 + 4);
  EXPECT_EQ(view.At(2, 3, 1), static_cast<void*>(storage + 39));
  const StridedView<3> read_only = view.AsConst();
  EXPECT_EQ(read_only.At(1, 0, 2), static_cast<const void*>(storage + 24));
  EXPECT_EQ(CeilDiv(0, 4), 0);
  EXPECT_EQ(CeilDiv(9, 4), 3);
  EXPECT_EQ(RoundUp(9, 4), 12);
  EXPECT_EQ(RoundUp(12, 4), 12);
}

}  // namespace
}  // namespace tokamax
