// Packed copies of a batch of matrices for TileGemm and the bf16 product engine.
#include "csrc/core/gemm/gemm_tiles.h"

#include <algorithm>

#include "csrc/core/gemm/bf16_gemm.h"
#include "csrc/core/base/int_math.h"
#include "csrc/core/runtime/parallel.h"

namespace tokamax {

PackedMatrixTiles::PackedMatrixTiles(const GemmKernels& gemm, const StridedView<4>& x, int64_t block, bool as_a,
                                     bool pack_all)
    : gemm_(gemm), x_(x), block_(block), as_a_(as_a) {
  const int64_t batch = x.sizes[0], rows = x.sizes[1], inner = x.sizes[2], cols = x.sizes[3];
  blocks_per_matrix_ = CeilDiv(rows, block);
  tile_floats_ = as_a ? RoundUp(block, gemm.mr) * cols : block * RoundUp(cols, gemm.nr);
  if (!pack_all) return;
  const int64_t tiles = batch * inner * blocks_per_matrix_;
  // Every float a tile read uses is written below.
  data_ = LargeBuffer<float>(tiles * tile_floats_, LargeBuffer<float>::kUninitialized);
  ParallelFor(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t matrix = i / blocks_per_matrix_, row0 = (i % blocks_per_matrix_) * block;
      PackInto(matrix / inner, matrix % inner, row0, std::min(block, rows - row0), data_.data() + i * tile_floats_);
    }
  });
}

Panels PackedMatrixTiles::Tile(int64_t i0, int64_t i2, int64_t row0, int64_t rows, float* scratch) const {
  const float* data = scratch;
  int64_t depth_rows = rows;  // the rows a B panel holds
  if (data_.data() != nullptr) {
    data = data_.data() + ((i0 * x_.sizes[2] + i2) * blocks_per_matrix_ + row0 / block_) * tile_floats_;
    depth_rows = std::min(block_, x_.sizes[1] - row0);
  } else {
    PackInto(i0, i2, row0, rows, scratch);
  }
  const int64_t cols = x_.sizes[3];
  return as_a_ ? PackedA(data, cols, gemm_.mr) : PackedB(data, depth_rows, gemm_.nr);
}

void PackedMatrixTiles::PackInto(int64_t i0, int64_t i2, int64_t row0, int64_t rows, float* dst) const {
  const ConstMatrix m = MatrixOf(x_, i0, i2, row0, rows);
  if (as_a_) {
    gemm_.pack_a(m, 0, rows, 0, x_.sizes[3], nullptr, dst);
  } else {
    gemm_.pack_b(m, 0, rows, 0, x_.sizes[3], dst);
  }
}

Bf16MatrixCopy::Bf16MatrixCopy(const StridedView<4>& x, Layout layout) : x_(x), layout_(layout) {
  const int64_t batch = x.sizes[0], rows = x.sizes[1], inner = x.sizes[2], cols = x.sizes[3];
  rows_ = RoundUp(rows + kBf16TileRows, kBf16TileRows);
  ld_ = layout == kRows ? cols : rows_ + 2 * kBf16TileRows;
  matrix_elements_ = layout == kRows ? rows_ * cols : cols * ld_;
  const int64_t matrices = batch * inner;
  data_ = LargeBuffer<uint16_t>(matrices * matrix_elements_, LargeBuffer<uint16_t>::kUninitialized);
  ParallelFor(0, matrices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) Pack(m / inner, m % inner, data_.data() + m * matrix_elements_);
  });
}

void Bf16MatrixCopy::Pack(int64_t i0, int64_t i2, uint16_t* dst) const {
  const int64_t rows = x_.sizes[1], cols = x_.sizes[3];
  const uint16_t* src = static_cast<const uint16_t*>(x_.At(i0, 0, i2, 0));
  CopyBf16(src, x_.strides[1], x_.strides[3], rows, cols, layout_ == kTransposed, dst, ld_);
  if (layout_ == kRows) {
    std::fill(dst + rows * ld_, dst + matrix_elements_, uint16_t{0});
    return;
  }
  for (int64_t c = 0; c < cols; ++c) std::fill(dst + c * ld_ + rows, dst + (c + 1) * ld_, uint16_t{0});
}

}  // namespace tokamax
