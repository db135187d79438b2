// Visibility of (b, n, t, s) pairs, shared by the kernels and the float64 reference so both
// apply exactly the same masks. Internal to dot_product_attention.
#pragma once

#include <algorithm>
#include <cstdint>

#include "csrc/ops/dot_product_attention/dot_product_attention.h"

namespace tokamax {
namespace attention {

// Keys [begin, end) allowed by the causal, window and length masks (and a bool mask folded into
// runs) for query t of head n, batch b; empty (begin >= end) when the query itself is past its
// sequence length.
struct KeyRange {
  int64_t begin;
  int64_t end;
};

inline KeyRange VisibleKeys(const AttentionMasks& m, int64_t b, int64_t n, int64_t t, int64_t kv_len) {
  if (m.q_lengths != nullptr && t >= m.q_lengths[b]) return {0, 0};
  int64_t end = m.kv_lengths != nullptr ? std::min(kv_len, m.kv_lengths[b]) : kv_len;
  if (m.is_causal) end = std::min(end, t + 1);
  if (m.window_right < AttentionMasks::kUnbounded) end = std::min(end, t + m.window_right + 1);
  int64_t begin = 0;
  if (m.window_left < AttentionMasks::kUnbounded) begin = std::max<int64_t>(0, t - m.window_left);
  if (m.mask_runs != nullptr) {
    const int64_t* run = m.mask_runs + 2 * (b * m.mask_run_strides[0] + n * m.mask_run_strides[1] +
                                            t * m.mask_run_strides[2]);
    begin = std::max(begin, run[0]);
    end = std::min(end, run[1]);
  }
  return {begin, std::max(begin, end)};
}

// The masks that are not ranges: segment ids and the boolean mask tensor.
inline bool HasElementMasks(const AttentionMasks& m) {
  return m.q_segment_ids != nullptr || m.mask != nullptr;
}

inline int32_t QuerySegment(const AttentionMasks& m, int64_t b, int64_t t) {
  return m.q_segment_ids[b * m.q_segment_strides[0] + t * m.q_segment_strides[1]];
}

inline int32_t KeySegment(const AttentionMasks& m, int64_t b, int64_t s) {
  return m.kv_segment_ids[b * m.kv_segment_strides[0] + s * m.kv_segment_strides[1]];
}

// The bool mask's bytes for query t of head n, batch b: key s at MaskRow(...)[s * mask_strides[3]].
inline const uint8_t* MaskRow(const AttentionMasks& m, int64_t b, int64_t n, int64_t t) {
  const int64_t* st = m.mask_strides;
  return m.mask + b * st[0] + n * st[1] + t * st[2];
}

inline bool ElementVisible(const AttentionMasks& m, int64_t b, int64_t n, int64_t t, int64_t s) {
  if (m.q_segment_ids != nullptr && QuerySegment(m, b, t) != KeySegment(m, b, s)) return false;
  if (m.mask != nullptr) return MaskRow(m, b, n, t)[s * m.mask_strides[3]] != 0;
  return true;
}

inline bool Visible(const AttentionMasks& m, int64_t b, int64_t n, int64_t t, int64_t s, int64_t kv_len) {
  const KeyRange range = VisibleKeys(m, b, n, t, kv_len);
  return s >= range.begin && s < range.end && ElementVisible(m, b, n, t, s);
}

// Element (i0, i1, i2, i3) of a 4-D view as float; any storage dtype.
inline float LoadElement(const StridedView<4>& view, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  const int64_t offset = view.Offset(i0, i1, i2, i3);
  return DispatchDType(view.dtype, [&](auto tag) {
    using T = decltype(tag);
    return LoadAsFloat(static_cast<const T*>(view.data) + offset);
  });
}

inline double LoadElementDouble(const StridedView<4>& view, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  if (view.dtype != DType::kFloat64) return LoadElement(view, i0, i1, i2, i3);
  const int64_t offset = view.Offset(i0, i1, i2, i3);
  return static_cast<const double*>(view.data)[offset];
}

inline void StoreElementDouble(const MutableStridedView<4>& view, int64_t i0, int64_t i1, int64_t i2, int64_t i3,
                               double value) {
  const int64_t offset = view.Offset(i0, i1, i2, i3);
  if (view.dtype == DType::kFloat64) {
    static_cast<double*>(view.data)[offset] = value;
    return;
  }
  DispatchDType(view.dtype, [&](auto tag) {
    using T = decltype(tag);
    StoreFromFloat(static_cast<T*>(view.data) + offset, static_cast<float>(value));
    return 0;
  });
}

}  // namespace attention
}  // namespace tokamax
