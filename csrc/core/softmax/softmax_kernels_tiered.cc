// The loops of SoftmaxKernels, written once over the vector layer (csrc/core/vec/vec.h) and
// compiled once per tier below. Every sum runs in a fixed order, so results are bitwise
// reproducible for a given tier.
// tokamax-tiers: scalar avx2 avx512
#include "csrc/core/vec/vec.h"

#include "csrc/core/softmax/softmax_kernels.h"

namespace tokamax {
namespace TOKAMAX_TIER_NAMESPACE {
namespace softmax {

void ColumnMax(const float* x, int64_t rows, int64_t ld, int64_t cols, float* max) {
  for (int64_t c = 0; c < cols; c += kLanes) {
    Vec m = Load(max + c);
    for (int64_t r = 0; r < rows; ++r) m = Max(m, Load(x + r * ld + c));
    Store(max + c, m);
  }
}

void ExpColumns(float* x, int64_t rows, int64_t ld, int64_t cols, const float* sub, float* sums) {
  for (int64_t c = 0; c < cols; c += kLanes) {
    const Vec s = Load(sub + c);
    Vec total = Set1(0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const Vec e = Exp(Sub(Load(x + r * ld + c), s));
      Store(x + r * ld + c, e);
      total = Add(total, e);
    }
    if (sums != nullptr) Store(sums + c, Add(Load(sums + c), total));
  }
}

void MaskColumns(float* x, int64_t rows, int64_t ld, int64_t cols, const float* lo, const float* hi) {
  for (int64_t c = 0; c < cols; c += kLanes) {
    const Vec lo_c = Load(lo + c), hi_c = Load(hi + c);
    for (int64_t r = 0; r < rows; ++r) {
      Store(x + r * ld + c, InRange(Load(x + r * ld + c), Set1(static_cast<float>(r)), lo_c, hi_c));
    }
  }
}

void SoftCap(float* x, int64_t rows, int64_t ld, int64_t cols, float cap, float* slope, int64_t ld_slope) {
  const Vec cap_v = Set1(cap), inv_cap = Set1(1.0f / cap);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * ld;
    float* slope_row = slope != nullptr ? slope + r * ld_slope : nullptr;
    // x -> (capped, slope) on one vector; whole vectors, then the tail's partial ones (AVX2's
    // masked stores are slow: only where needed).
    auto cap_lanes = [&](Vec x, Vec* slope_lanes) {
      return Mul(cap_v, Tanh(Mul(x, inv_cap), slope_row != nullptr ? slope_lanes : nullptr));
    };
    Vec s;
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes) {
      Store(row + c, cap_lanes(Load(row + c), &s));
      if (slope_row != nullptr) Store(slope_row + c, s);
    }
    if (c < cols) {
      const int64_t n = cols - c;
      StorePartial(row + c, cap_lanes(LoadPartial(row + c, n), &s), n);
      if (slope_row != nullptr) StorePartial(slope_row + c, s, n);
    }
  }
}

void ScaleRows(float* x, int64_t ld, int64_t rows, int64_t width, const float* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    if (scale[r] == 1.0f) continue;
    const float s = scale[r];
    float* row = x + r * ld;
    for (int64_t e = 0; e < width; ++e) row[e] *= s;
  }
}

void ScaleColumns(float* x, int64_t ld, int64_t rows, int64_t cols, const float* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += kLanes) Store(x + r * ld + c, Mul(Load(x + r * ld + c), Load(scale + c)));
  }
}

void TransposePanels(const float* x, int64_t ld, int64_t rows, int64_t cols, int64_t nr, float* dst) {
  for (int64_t q = 0; q * nr < rows; ++q) {
    float* panel = dst + q * cols * nr;
    for (int64_t j0 = 0; j0 < nr; j0 += 8) {
      const int64_t r0 = q * nr + j0;
      const int64_t valid = std::min<int64_t>(std::max<int64_t>(rows - r0, 0), 8);
      int64_t h0 = 0;
      if (valid == 8) {
        for (; h0 + 8 <= cols; h0 += 8) Transpose8x8(x + r0 * ld + h0, ld, panel + h0 * nr + j0, nr);
      }
      for (int64_t h = h0; h < cols; ++h) {
        for (int64_t j = 0; j < 8; ++j) panel[h * nr + j0 + j] = j < valid ? x[(r0 + j) * ld + h] : 0.0f;
      }
    }
  }
}

void SoftmaxGradColumns(const float* p, float* dp, int64_t rows, int64_t ld, int64_t cols, const float* d) {
  for (int64_t c = 0; c < cols; c += kLanes) {
    const Vec dc = Load(d + c);
    for (int64_t r = 0; r < rows; ++r) {
      Store(dp + r * ld + c, Mul(Load(p + r * ld + c), Sub(Load(dp + r * ld + c), dc)));
    }
  }
}

void WidenRow(DType dtype, const void* x, int64_t count, float scale, float* dst) {
  DispatchDType(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(x);
    const Vec s = Set1(scale);
    int64_t h = 0;
    for (; h + kLanes <= count; h += kLanes) Store(dst + h, Mul(s, LoadWiden(src + h)));
    for (; h < count; ++h) dst[h] = scale * LoadAsFloat(src + h);
    return 0;
  });
}

}  // namespace softmax

const SoftmaxKernels& SoftmaxKernelTable() {
  using namespace softmax;
  static const SoftmaxKernels kernels = [] {
    SoftmaxKernels kernels{};
    kernels.column_max = &ColumnMax;
    kernels.exp_columns = &ExpColumns;
    kernels.mask_columns = &MaskColumns;
    kernels.soft_cap = &SoftCap;
    kernels.scale_rows = &ScaleRows;
    kernels.transpose_panels = &TransposePanels;
    kernels.softmax_grad_columns = &SoftmaxGradColumns;
    kernels.scale_columns = &ScaleColumns;
    kernels.widen_row = &WidenRow;
    return kernels;
  }();
  return kernels;
}

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
