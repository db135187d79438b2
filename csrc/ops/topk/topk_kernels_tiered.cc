// tokamax-tiers: scalar avx2 avx512
// The row selection of topk.h, per tier: a vector threshold scan (GreaterMask against the k-th
// value so far) finds the few lanes that can enter the selection; only those go through the
// scalar insertion. On random rows about k·(1 + ln(n/k)) elements enter, so the scan dominates.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "csrc/core/vec/vec.h"
#include "csrc/ops/topk/topk.h"

namespace tokamax {
namespace TOKAMAX_TIER_NAMESPACE {
namespace {

// Up to this k an insertion shifts in one loop; above it, binary search and memmove.
constexpr int64_t kLinearInsertMax = 32;

// The selection so far: vals/idx[0..count) descending, ties in column order.
struct Selection {
  float* vals;
  int32_t* idx;
  int64_t k;
  float floor;
  int64_t count = 0;
  float seed = floor;  // >= floor; below the k-th largest value of the row (see SeedThreshold)

  // What an element must exceed to enter: strict, so an equal later column never displaces an
  // earlier one (ties go to the lower column).
  float Threshold() const { return count < k ? seed : vals[k - 1]; }

  void Offer(float v, int64_t col) {
    if (!(v > Threshold())) return;  // NaN never enters
    const int64_t last = count < k ? count++ : k - 1;  // the slot that falls off (or the new one)
    int64_t lo = last;
    if (k <= kLinearInsertMax) {
      // Short selections (routers: k = 8): shifting in one loop beats a search and two memmoves.
      for (; lo > 0 && vals[lo - 1] < v; --lo) {
        vals[lo] = vals[lo - 1];
        idx[lo] = idx[lo - 1];
      }
    } else {
      lo = 0;  // the first slot holding a value < v
      for (int64_t hi = last; lo < hi;) {
        const int64_t mid = (lo + hi) / 2;
        if (vals[mid] < v) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      std::memmove(vals + lo + 1, vals + lo, (last - lo) * sizeof(float));
      std::memmove(idx + lo + 1, idx + lo, (last - lo) * sizeof(int32_t));
    }
    vals[lo] = v;
    idx[lo] = static_cast<int32_t>(col);
  }
};

// A strict lower bound t (>= floor) of the row's k-th largest value, from one pass of lane-wise
// maxima over the full vectors: the kLanes maxima are distinct elements, so if s is the k-th
// largest of them, k elements are >= s and nothing below s can be selected; t is the float just
// below s, so elements equal to s still enter (ties) and the result is the unseeded one. Without
// it a random row inserts about k·(1 + ln(n/k)) elements, a third of the row at n=64, k=8.
template <typename T>
float SeedThreshold(const T* row, int64_t n, int64_t k, float floor) {
  if (kLanes == 1 || k > kLanes || n < 2 * kLanes) return floor;
  Vec acc = Set1(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c + kLanes <= n; c += kLanes) acc = Max(LoadWiden(row + c), acc);
  float m[kLanes];
  Store(m, acc);
  for (float& x : m) x = x == x ? x : -std::numeric_limits<float>::infinity();  // a NaN lane bounds nothing
  const Vec all = Load(m);
  float s = std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < kLanes; ++l) {
    // m[l] is among the k largest maxima (ties kept) when fewer than k exceed it.
    if (__builtin_popcount(GreaterMask(all, Set1(m[l]))) < k) s = std::min(s, m[l]);
  }
  return s > floor ? std::nextafter(s, -std::numeric_limits<float>::infinity()) : floor;
}

template <typename T>
int64_t SelectRow(const void* data, int64_t stride, int64_t n, int64_t k, float floor, float* vals, int32_t* idx) {
  const T* row = static_cast<const T*>(data);
  Selection selection{vals, idx, k, floor};
  if (stride != 1) {
    for (int64_t c = 0; c < n; ++c) selection.Offer(LoadAsFloat(row + c * stride), c);
    return selection.count;
  }
  selection.seed = SeedThreshold(row, n, k, floor);
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    uint32_t mask = GreaterMask(LoadWiden(row + c), Set1(selection.Threshold()));
    for (; mask != 0; mask &= mask - 1) {
      const int64_t lane = __builtin_ctz(mask);
      selection.Offer(LoadAsFloat(row + c + lane), c + lane);
    }
  }
  if (c < n) {
    uint32_t mask = GreaterMask(LoadWidenPartial(row + c, n - c), Set1(selection.Threshold()));
    mask &= (uint32_t{1} << (n - c)) - 1;  // the zero-filled lanes past n are not elements
    for (; mask != 0; mask &= mask - 1) {
      const int64_t lane = __builtin_ctz(mask);
      selection.Offer(LoadAsFloat(row + c + lane), c + lane);
    }
  }
  return selection.count;
}

}  // namespace

const TopKKernels& TopKKernelTable() {
  static const TopKKernels table{&SelectRow<float>, &SelectRow<BFloat16Bits>, &SelectRow<Float16Bits>};
  return table;
}

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
