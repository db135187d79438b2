// ragged_gather_reduce's row sum on the vector layer, shared by its forward (each token's weighted
// sum of its gathered rows) and its backward's dx (each row's weighted sum of the dout rows that
// gathered it). The scalar loop of moe_gather.cc ran at 28-60% of a copy's bandwidth: perf put
// half of its samples on the first load of each gathered row (a fresh 4 KiB page per row: no
// hardware prefetch across it) and the loop ran at the baseline's 4 lanes with the accumulator in
// memory. Here the sum stays in a register across the rows, and the next call's rows are
// prefetched to L2 one cache line per line summed.
// tokamax-tiers: scalar avx2 avx512
#include "csrc/core/vec/vec.h"

#include "csrc/ops/moe_gather/moe_gather.h"

namespace tokamax {
namespace TOKAMAX_TIER_NAMESPACE {
namespace {

template <typename T>
void SumRows(const void* const* rows_p, const float* w, int64_t count, const void* const* next_p, int64_t next_count,
             void* out_p, int64_t width) {
  const T* const* rows = reinterpret_cast<const T* const*>(rows_p);
  const T* const* next = reinterpret_cast<const T* const*>(next_p);
  T* out = static_cast<T*>(out_p);
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line; kLanes divides it
  // The first row initialises the sum (w * x, not 0 + w * x): weight 1 copies x exactly, -0.0 included.
  auto sum = [&](auto load, int64_t h) {
    if (count == 0) return Zero();
    Vec acc = Mul(Set1(w[0]), load(rows[0] + h));
    for (int64_t i = 1; i < count; ++i) acc = Add(acc, Mul(Set1(w[i]), load(rows[i] + h)));
    return acc;
  };
  int64_t h = 0;
  for (; h + kLanes <= width; h += kLanes) {
    if (h % kLine == 0) {
      for (int64_t i = 0; i < next_count; ++i) PrefetchToL2(next[i] + h);
    }
    StoreNarrow(out + h, sum([](const T* p) { return LoadWiden(p); }, h));
  }
  if (h < width) {
    const int64_t tail = width - h;
    StoreNarrowPartial(out + h, sum([tail](const T* p) { return LoadWidenPartial(p, tail); }, h), tail);
  }
}

}  // namespace

GatherSumRowsFn GatherSumRows(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return &SumRows<float>;
    case DType::kBFloat16: return &SumRows<BFloat16Bits>;
    case DType::kFloat16: return &SumRows<Float16Bits>;
    default: break;  // float64: the exact loop of moe_gather.cc
  }
  return nullptr;
}

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
