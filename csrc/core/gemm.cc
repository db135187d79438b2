// The GEMM driver: cache blocking and the loops around the per-ISA micro-kernels.
#include "csrc/core/gemm.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <cstring>
#include <memory>
#include <vector>

namespace tokamax {

const GemmKernels& GemmKernelsScalar();
const GemmKernels& GemmKernelsAvx2();
const GemmKernels& GemmKernelsAvx512();

const GemmKernels& GetGemmKernels(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
    case Isa::kAmx: return GemmKernelsAvx512();  // bf16 tile products: amx_gemm.h
    case Isa::kAvx2: return GemmKernelsAvx2();
    case Isa::kScalar: break;
  }
  return GemmKernelsScalar();
}

namespace {

int64_t RoundUp(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// A grow-only, 64-byte aligned float buffer. Contents are never read before being written.
class ScratchBuffer {
 public:
  float* Get(int64_t count) {
    if (count > capacity_) {
      const size_t bytes = static_cast<size_t>(RoundUp(count * 4, 64));
      data_.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
      if (data_ == nullptr) throw std::bad_alloc();
      capacity_ = count;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
  int64_t capacity_ = 0;
};

struct GemmScratch {
  ScratchBuffer a_pack, b_pack, b_tail, acc;
};

GemmScratch& ThreadScratch() {
  thread_local GemmScratch scratch;
  return scratch;
}

// Runs the micro-kernel on B read in place at element (k0, col), of B's own dtype.
void MicroInPlace(const GemmKernels& kernels, const ConstMatrix& b, int64_t depth, const float* a,
                  int64_t k0, int64_t col, float* c, int64_t ldc, bool accumulate) {
  const int64_t offset = k0 * b.row_stride + col;
  switch (b.dtype) {
    case DType::kFloat32:
      kernels.micro_f32(depth, a, kernels.mr, static_cast<const float*>(b.data) + offset, b.row_stride, c, ldc,
                        accumulate);
      return;
    case DType::kBFloat16:
      kernels.micro_bf16(depth, a, kernels.mr, static_cast<const uint16_t*>(b.data) + offset, b.row_stride, c,
                         ldc, accumulate);
      return;
    case DType::kFloat16:
      kernels.micro_f16(depth, a, kernels.mr, static_cast<const uint16_t*>(b.data) + offset, b.row_stride, c,
                        ldc, accumulate);
      return;
    case DType::kFloat64:  // never here: GemmRegion sends float64 to GemmRegionFloat64
      return;
  }
}

// float64 (A, B and C): exact double-precision loops, for gradcheck and oracles.
void GemmRegionFloat64(const ConstMatrix& a, const ConstMatrix& b, const MutableMatrix& c, int64_t m0,
                       int64_t m1, int64_t n0, int64_t n1) {
  const double* a_data = static_cast<const double*>(a.data);
  const double* b_data = static_cast<const double*>(b.data);
  double* c_data = static_cast<double*>(c.data);
  for (int64_t i = m0; i < m1; ++i) {
    for (int64_t j = n0; j < n1; ++j) {
      double sum = 0.0;
      for (int64_t p = 0; p < a.cols; ++p) {
        sum += a_data[i * a.row_stride + p * a.col_stride] * b_data[p * b.row_stride + j * b.col_stride];
      }
      c_data[i * c.row_stride + j * c.col_stride] = sum;
    }
  }
}

}  // namespace

void GemmRegion(const GemmKernels& kernels, const ConstMatrix& a, const ConstMatrix& b,
                const MutableMatrix& c, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                const GemmBlocking& blocking) {
  if (m1 <= m0 || n1 <= n0) return;
  if (a.dtype == DType::kFloat64) {
    GemmRegionFloat64(a, b, c, m0, m1, n0, n1);
    return;
  }
  GemmScratch& scratch = ThreadScratch();
  const int64_t mr = kernels.mr;
  const int64_t nr = kernels.nr;
  const int64_t depth_total = a.cols;
  const int64_t rows = m1 - m0;
  const int64_t rows_padded = RoundUp(rows, mr);
  // A tier whose tile is taller than block_m's granularity rounds block_m up to whole tiles,
  // so micro-kernel tiles never straddle two row blocks.
  const int64_t block_m = RoundUp(blocking.block_m, mr);
  const int64_t block_k = blocking.block_k;
  // Reading B in place needs contiguous columns.
  const bool in_place_b = !blocking.pack_b && b.col_stride == 1;

  for (int64_t jc = n0; jc < n1; jc += blocking.block_n) {
    const int64_t cols = std::min(blocking.block_n, n1 - jc);
    const int64_t cols_padded = RoundUp(cols, nr);
    const int64_t full_panels = cols / nr;
    float* acc = scratch.acc.Get(rows_padded * cols_padded);
    if (depth_total == 0) std::memset(acc, 0, sizeof(float) * rows_padded * cols_padded);

    for (int64_t pc = 0; pc < depth_total; pc += block_k) {
      const int64_t depth = std::min(block_k, depth_total - pc);
      const bool accumulate = pc > 0;
      float* b_pack = nullptr;
      float* b_tail = nullptr;
      if (!in_place_b) {
        b_pack = scratch.b_pack.Get(depth * cols_padded);
        kernels.pack_b(b, pc, depth, jc, cols, b_pack);
      } else if (cols > full_panels * nr) {
        // The last, partial panel is packed so the micro-kernel never reads past B's columns.
        b_tail = scratch.b_tail.Get(depth * nr);
        kernels.pack_b(b, pc, depth, jc + full_panels * nr, cols - full_panels * nr, b_tail);
      }

      for (int64_t ic = m0; ic < m1; ic += block_m) {
        const int64_t block_rows = std::min(block_m, m1 - ic);
        float* a_pack = scratch.a_pack.Get(RoundUp(block_rows, mr) * depth);
        kernels.pack_a(a, ic, block_rows, pc, depth, a_pack);
        float* acc_block = acc + (ic - m0) * cols_padded;

        for (int64_t jr = 0; jr < cols; jr += nr) {
          const int64_t panel = jr / nr;
          for (int64_t ir = 0; ir < block_rows; ir += mr) {
            const float* a_panel = a_pack + ir * depth;
            float* c_tile = acc_block + ir * cols_padded + jr;
            if (!in_place_b) {
              kernels.micro_f32(depth, a_panel, mr, b_pack + panel * depth * nr, nr, c_tile,
                                cols_padded, accumulate);
            } else if (panel < full_panels) {
              MicroInPlace(kernels, b, depth, a_panel, pc, jc + jr, c_tile, cols_padded, accumulate);
            } else {
              kernels.micro_f32(depth, a_panel, mr, b_tail, nr, c_tile, cols_padded, accumulate);
            }
          }
        }
      }
    }
    kernels.store_c(acc, cols_padded, rows, cols, c, m0, jc);
  }
}

void ReferenceGemm(const ConstMatrix& a, const ConstMatrix& b, const MutableMatrix& c) {
  auto load = [](const ConstMatrix& m, int64_t i, int64_t j) -> double {
    const int64_t offset = i * m.row_stride + j * m.col_stride;
    if (m.dtype == DType::kFloat64) return static_cast<const double*>(m.data)[offset];  // exact
    return DispatchDType(m.dtype, [&](auto tag) -> double {
      using T = decltype(tag);
      return LoadAsFloat(static_cast<const T*>(m.data) + offset);
    });
  };
  for (int64_t i = 0; i < c.rows; ++i) {
    for (int64_t j = 0; j < c.cols; ++j) {
      double sum = 0.0;
      for (int64_t p = 0; p < a.cols; ++p) sum += load(a, i, p) * load(b, p, j);
      const int64_t offset = i * c.row_stride + j * c.col_stride;
      if (c.dtype == DType::kFloat64) {
        static_cast<double*>(c.data)[offset] = sum;
        continue;
      }
      DispatchDType(c.dtype, [&](auto tag) {
        using T = decltype(tag);
        StoreFromFloat(static_cast<T*>(c.data) + offset, static_cast<float>(sum));
        return 0;
      });
    }
  }
}

}  // namespace tokamax
