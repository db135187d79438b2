// Whole-tile products for kernels that keep their own fp32 tiles between products (attention's
// logits and accumulators, later fused MLPs and losses) instead of calling GemmRegion: operands as
// micro-kernel panels, packed or read in place, and packed copies of a batch of matrices.
//
// TileGemm is the driver's inner loop (gemm.cc) without its blocking: the caller sizes the tile
// to its cache and decides what is packed when, and applies its own epilogue to the fp32 tile
// afterwards, vectorized across the whole tile (the softmax kernels, softmax_kernels.h). The
// order in which each element accumulates is the micro-kernel's over `depth`, so a tile's
// result is the same bits whichever way its operands were supplied (packed or in place).
#pragma once

#include <cstdint>

#include "csrc/core/gemm/gemm.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/base/strided_view.h"

namespace tokamax {

// A TileGemm operand: mr-row panels of A or nr-wide panels of B; depth step p of panel i is at
// data + i * panel_stride + p * step. Packed panels have step mr (A) or nr (B); A with a larger
// step is an fp32 tile read in place.
struct Panels {
  const float* data;
  int64_t step;
  int64_t panel_stride;
};

// A fp32 tile x[p][i] (p < depth, ld floats apart) read in place as A panels: row i, depth p.
// Whole mr-row panels may read up to mr - 1 floats past the last row's columns.
inline Panels InPlaceA(const float* x, int64_t ld, int64_t mr) { return {x, ld, mr}; }

// Packed A panels of `depth` (GemmKernels::pack_a's layout).
inline Panels PackedA(const float* x, int64_t depth, int64_t mr) { return {x, mr, mr * depth}; }

// Packed B panels of `depth` (GemmKernels::pack_b's layout).
inline Panels PackedB(const float* x, int64_t depth, int64_t nr) { return {x, nr, depth * nr}; }

// c (+)= a · b over whole tiles: `row_panels` panels of A times `col_panels` panels of B, c's
// micro-tiles (mr x nr) ldc floats per row.
inline void TileGemm(const GemmKernels& kernels, int64_t depth, const Panels& a, int64_t row_panels, const Panels& b,
                     int64_t col_panels, float* c, int64_t ldc, bool accumulate) {
  const int64_t mr = kernels.mr, nr = kernels.nr;
  for (int64_t qi = 0; qi < col_panels; ++qi) {
    for (int64_t pi = 0; pi < row_panels; ++pi) {
      kernels.micro_f32(mr, depth, a.data + pi * a.panel_stride, a.step, b.data + qi * b.panel_stride, b.step,
                        c + pi * mr * ldc + qi * nr, ldc, accumulate);
    }
  }
}

// The [rows, cols] matrix x[i0, row0 : row0 + rows, i2, :] of a 4-D view (dims 0 and 2 index a
// batch of matrices, dim 1 their rows, dim 3 their columns) as a GEMM operand.
inline ConstMatrix MatrixOf(const StridedView<4>& x, int64_t i0, int64_t i2, int64_t row0, int64_t rows) {
  return {x.At(i0, row0, i2, 0), x.dtype, rows, x.sizes[3], x.strides[1], x.strides[3]};
}

// Every matrix x[i0, :, i2, :] of a 4-D view as a TileGemm operand, in row blocks of `block`
// rows: as A, mr-row panels whose depth is the columns; as B, nr-wide panels whose depth is the
// block's rows. With `pack_all` every block is packed once, in parallel, at construction (an
// fp32 copy of x, O(x) memory): that pays when several tiles read each block. Otherwise Tile()
// packs the block it is asked for into the caller's scratch.
class PackedMatrixTiles {
 public:
  PackedMatrixTiles(const GemmKernels& gemm, const StridedView<4>& x, int64_t block, bool as_a, bool pack_all);
  // Floats of scratch that Tile() may use.
  int64_t tile_floats() const { return tile_floats_; }
  // Rows [row0, row0 + rows) of matrix (i0, i2) (row0 a block start, rows at most the block's):
  // the packed copy, or packed into `scratch` now.
  Panels Tile(int64_t i0, int64_t i2, int64_t row0, int64_t rows, float* scratch) const;

 private:
  void PackInto(int64_t i0, int64_t i2, int64_t row0, int64_t rows, float* dst) const;

  const GemmKernels& gemm_;
  StridedView<4> x_;
  int64_t block_, blocks_per_matrix_ = 0, tile_floats_ = 0;
  bool as_a_;
  LargeBuffer<float> data_;  // empty unless pack_all
};

// Every matrix x[i0, :, i2, :] of a bf16 4-D view as an A operand of the bf16 product engine
// (bf16_gemm.h), copied once at construction (in parallel; O(x) memory), in one of two layouts:
//  - kRows: row-major [rows + 16 rounded up to 16][cols]: 16-row tiles read whole from any row
//    start that is a multiple of 8;
//  - kTransposed: [cols][ld], ld that row count plus 32: the transpose, read 32 rows deep from
//    any row start.
// Padding is zero, so every tile read stays in the copy and adds nothing. Needs the avx512bf16
// or amx tier (the copy runs its packers).
class Bf16MatrixCopy {
 public:
  enum Layout { kRows, kTransposed };
  Bf16MatrixCopy(const StridedView<4>& x, Layout layout);
  // kRows: the rows from row0 on; kTransposed: the columns from row0 on. ld() apart.
  const uint16_t* At(int64_t i0, int64_t i2, int64_t row0) const {
    const uint16_t* matrix = data_.data() + (i0 * x_.sizes[2] + i2) * matrix_elements_;
    return matrix + (layout_ == kRows ? row0 * ld_ : row0);
  }
  int64_t ld() const { return ld_; }

 private:
  void Pack(int64_t i0, int64_t i2, uint16_t* dst) const;

  StridedView<4> x_;
  Layout layout_;
  int64_t rows_ = 0, ld_ = 0, matrix_elements_ = 0;
  LargeBuffer<uint16_t> data_;
};

}  // namespace tokamax
