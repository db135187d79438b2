// The column loops of linear_softmax_cross_entropy_loss (LinearCrossEntropyKernels), written once
// over the vector layer (csrc/core/vec/vec.h) and compiled once per tier below. A column is one
// batch row; its sums run down the tile's rows in order, so the bits depend on the tier only.
// tokamax-tiers: scalar avx2 avx512
#include "csrc/core/vec/vec.h"

#include <limits>

#include "csrc/ops/linear_softmax_cross_entropy_loss/linear_softmax_cross_entropy_loss.h"

namespace tokamax {
namespace TOKAMAX_TIER_NAMESPACE {
namespace linear_cross_entropy {

void ForwardTile(const float* z, int64_t rows, int64_t ld, int64_t cols, float* max, float* sum, float* zsum) {
  for (int64_t c = 0; c < cols; c += kLanes) {
    const Vec old_max = Load(max + c);
    Vec m = old_max;
    for (int64_t v = 0; v < rows; ++v) m = Max(m, Load(z + v * ld + c));
    // The shift: the max, or the lowest float while every logit so far is -inf (only infinite
    // inputs give that), so exp sees -inf - lowest = -inf, exactly 0, not -inf - -inf = NaN
    // (Exp keeps NaN). The old sum rescaled: a first tile's old max is -inf and its sum 0.
    const Vec shift = Max(m, Set1(std::numeric_limits<float>::lowest()));
    Vec total = Mul(Load(sum + c), Exp(Sub(old_max, shift)));
    Vec zs = Zero();
    for (int64_t v = 0; v < rows; ++v) {
      const Vec x = Load(z + v * ld + c);
      total = Add(total, Exp(Sub(x, shift)));
      zs = Add(zs, x);
    }
    Store(max + c, m);
    Store(sum + c, total);
    if (zsum != nullptr) Store(zsum + c, Add(Load(zsum + c), zs));
  }
}

template <typename Out>
void BackwardTileAs(const float* z, int64_t rows, int64_t ld, int64_t cols, const float* lse, const float* a,
                    const float* b, const float* label_row, const float* c1, float cap_inv_sq, Out* out,
                    int64_t out_ld) {
  const Vec one = Set1(1.0f), zero = Zero(), cis = Set1(cap_inv_sq);
  for (int64_t c = 0; c < cols; c += kLanes) {
    const Vec l = Load(lse + c), ac = Load(a + c), bc = Load(b + c), cc = Load(c1 + c);
    const Vec label = Load(label_row + c), label_end = Add(label, one);
    for (int64_t v = 0; v < rows; ++v) {
      const Vec x = Load(z + v * ld + c);
      // 1 where v is the row's label, else 0 (InRange gives -inf outside).
      const Vec hit = Max(InRange(one, Set1(static_cast<float>(v)), label, label_end), zero);
      Vec d = Sub(Sub(Mul(ac, Exp(Sub(x, l))), bc), Mul(cc, hit));
      if (cap_inv_sq != 0.0f) d = Mul(d, Sub(one, Mul(Mul(x, x), cis)));
      StoreNarrow(out + v * out_ld + c, d);
    }
  }
}

void BackwardTile(const float* z, int64_t rows, int64_t ld, int64_t cols, const float* lse, const float* a,
                  const float* b, const float* label_row, const float* c1, float cap_inv_sq, void* out,
                  DType out_dtype, int64_t out_ld) {
  if (out_dtype == DType::kBFloat16) {
    BackwardTileAs(z, rows, ld, cols, lse, a, b, label_row, c1, cap_inv_sq, static_cast<BFloat16Bits*>(out), out_ld);
  } else {
    BackwardTileAs(z, rows, ld, cols, lse, a, b, label_row, c1, cap_inv_sq, static_cast<float*>(out), out_ld);
  }
}

}  // namespace linear_cross_entropy

const LinearCrossEntropyKernels& LinearCrossEntropyKernelTable() {
  static const LinearCrossEntropyKernels kernels{&linear_cross_entropy::ForwardTile,
                                                 &linear_cross_entropy::BackwardTile};
  return kernels;
}

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
