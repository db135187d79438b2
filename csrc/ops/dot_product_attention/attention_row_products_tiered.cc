// The row products of attention's decode path (attention_row_products.h), written once over the
// vector layer (csrc/core/vec/vec.h) and compiled per tier; the avx512bf16 tier adds the bf16
// products on the AVX512-BF16 dot instruction (vdpbf16ps: 16 lanes, each the sum of two bf16
// products into fp32), which on Zen 4 retires 32 multiply-adds per cycle against the FMA's 16,
// and needs no widening of K and V. Every sum runs in a fixed order per tier.
// tokamax-tiers: scalar avx2 avx512 avx512bf16
#include "csrc/core/vec/vec.h"

#include <cstring>

#include "csrc/ops/dot_product_attention/attention_row_products.h"

namespace tokamax {
namespace TOKAMAX_TIER_NAMESPACE {
namespace row_products {

using attention::kMaxRowDotRows;

// st[k * ld_st + r] = key[k] · q[r] for the kKeys key rows of one group and kRows query rows.
// The kKeys x kRows products accumulate lane-wise in registers along h (q's kRows vectors
// loaded once per step, shared by the keys), then SumLanes turns each kLanes accumulators into
// one vector of their sums. Each dot is summed in the same order whatever group it falls in, so
// st does not depend on how the keys are split into tiles or groups.
template <typename T, int64_t kRows, int64_t kKeys>
[[gnu::always_inline]] inline void KeyDotsGroup(const T* key, int64_t ld_key, int64_t depth, const float* q,
                                                int64_t ld_q, float* st, int64_t ld_st, const T* next) {
  constexpr int64_t kAccumulators = RoundUp(kRows * kKeys, kLanes);
  Vec acc[kAccumulators];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kAccumulators; ++i) acc[i] = Set1(0.0f);
  int64_t h = 0;
  for (; h + kLanes <= depth; h += kLanes) {
    Vec qv[kRows];
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) qv[r] = Load(q + r * ld_q + h);
#pragma GCC unroll 16
    for (int64_t k = 0; k < kKeys; ++k) {
      const Vec kv = LoadWiden(key + k * ld_key + h);
      if (next != nullptr) PrefetchToL2(next + k * ld_key + h);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kRows; ++r) acc[k * kRows + r] = Fma(kv, qv[r], acc[k * kRows + r]);
    }
  }
  if (h < depth) {
    const int64_t tail = depth - h;
    Vec qv[kRows];
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) qv[r] = LoadWidenPartial(q + r * ld_q + h, tail);
#pragma GCC unroll 16
    for (int64_t k = 0; k < kKeys; ++k) {
      const Vec kv = LoadWidenPartial(key + k * ld_key + h, tail);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kRows; ++r) acc[k * kRows + r] = Fma(kv, qv[r], acc[k * kRows + r]);
    }
  }
  float sums[kAccumulators];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kAccumulators; i += kLanes) Store(sums + i, SumLanes(acc + i));
#pragma GCC unroll 16
  for (int64_t k = 0; k < kKeys; ++k) {
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) st[k * ld_st + r] = sums[k * kRows + r];
  }
}

// kRows is a compile-time constant so the partial sums live in registers: keys go in groups
// that fill one vector of sums (16 keys of one row, 4 keys of 4 rows, ...), the rest one by one.
template <typename T, int64_t kRows>
void KeyDotsTyped(const T* key, int64_t ld_key, int64_t keys, int64_t depth, const float* q, int64_t ld_q,
                  float* st, int64_t ld_st, const T* next) {
  constexpr int64_t kKeys = kLanes / kRows > 1 ? kLanes / kRows : 1;
  int64_t j = 0;
  for (; j + kKeys <= keys; j += kKeys) {
    KeyDotsGroup<T, kRows, kKeys>(key + j * ld_key, ld_key, depth, q, ld_q, st + j * ld_st, ld_st,
                                  next == nullptr ? nullptr : next + j * ld_key);
  }
  for (; j < keys; ++j) {
    KeyDotsGroup<T, kRows, 1>(key + j * ld_key, ld_key, depth, q, ld_q, st + j * ld_st, ld_st,
                              next == nullptr ? nullptr : next + j * ld_key);
  }
}

// Calls fn(std::integral_constant<int64_t, R>{}) for R = rows, 1 <= rows <= kRows: the row
// count as a compile-time constant, so the row products keep their accumulators in registers.
template <int64_t kRows, typename Fn>
inline void DispatchRows(int64_t rows, Fn&& fn) {
  if constexpr (kRows > 1) {
    if (rows < kRows) return DispatchRows<kRows - 1>(rows, fn);
  }
  fn(std::integral_constant<int64_t, kRows>{});
}

void KeyDots(DType dtype, const void* key, int64_t ld_key, int64_t keys, int64_t depth, const float* q,
             int64_t ld_q, int64_t rows, float* st, int64_t ld_st, const void* next) {
  if (rows <= 0) return;
  DispatchDType(dtype, [&](auto tag) {
    using T = decltype(tag);
    DispatchRows<kMaxRowDotRows>(rows, [&](auto row_count) {
      KeyDotsTyped<T, decltype(row_count)::value>(static_cast<const T*>(key), ld_key, keys, depth, q, ld_q, st,
                                                  ld_st, static_cast<const T*>(next));
    });
    return 0;
  });
}

// acc[r][e0 + e] += sum_j p[j][r] · value[j][e0 + e] for e < kVecs·kLanes: kRows x kVecs
// accumulators held in registers across all the keys, one broadcast of p per (key, row).
template <typename T, int64_t kRows, int64_t kVecs>
[[gnu::always_inline]] inline void AccumulateValuesBlock(const float* p, int64_t ld_p, int64_t keys, const T* value,
                                                         int64_t ld_value, int64_t e0, float* acc, int64_t ld_acc,
                                                         const T* next) {
  Vec a[kRows][kVecs];
#pragma GCC unroll 16
  for (int64_t r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
    for (int64_t i = 0; i < kVecs; ++i) a[r][i] = Load(acc + r * ld_acc + e0 + i * kLanes);
  }
  for (int64_t j = 0; j < keys; ++j) {
    const T* row = value + j * ld_value;
    Vec v[kVecs];
#pragma GCC unroll 16
    for (int64_t i = 0; i < kVecs; ++i) v[i] = LoadWiden(row + e0 + i * kLanes);
    if (next != nullptr) {
#pragma GCC unroll 16
      for (int64_t i = 0; i < kVecs; ++i) PrefetchToL2(next + j * ld_value + e0 + i * kLanes);
    }
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) {
      const Vec weight = Set1(p[j * ld_p + r]);
#pragma GCC unroll 16
      for (int64_t i = 0; i < kVecs; ++i) a[r][i] = Fma(weight, v[i], a[r][i]);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
    for (int64_t i = 0; i < kVecs; ++i) Store(acc + r * ld_acc + e0 + i * kLanes, a[r][i]);
  }
}

// Columns in blocks of kVecs vectors (as many accumulators as the tier keeps in registers),
// then single vectors, then the last width % kLanes columns one by one.
template <typename T, int64_t kRows>
void AccumulateValuesTyped(const float* p, int64_t ld_p, int64_t keys, const T* value, int64_t ld_value,
                           int64_t width, float* acc, int64_t ld_acc, const T* next) {
  constexpr int64_t kVecs = kAccumulatorRegisters / kRows > 1 ? kAccumulatorRegisters / kRows : 1;
  int64_t e0 = 0;
  for (; e0 + kVecs * kLanes <= width; e0 += kVecs * kLanes) {
    AccumulateValuesBlock<T, kRows, kVecs>(p, ld_p, keys, value, ld_value, e0, acc, ld_acc, next);
  }
  for (; e0 + kLanes <= width; e0 += kLanes) {
    AccumulateValuesBlock<T, kRows, 1>(p, ld_p, keys, value, ld_value, e0, acc, ld_acc, next);
  }
  for (int64_t j = 0; j < keys && e0 < width; ++j) {
    for (int64_t r = 0; r < kRows; ++r) {
      const float weight = p[j * ld_p + r];
      for (int64_t e = e0; e < width; ++e) acc[r * ld_acc + e] += weight * LoadAsFloat(value + j * ld_value + e);
    }
  }
}

void AccumulateValues(DType dtype, const float* p, int64_t ld_p, int64_t keys, int64_t rows, const void* value,
                      int64_t ld_value, int64_t width, float* acc, int64_t ld_acc, const void* next) {
  if (rows <= 0) return;
  DispatchDType(dtype, [&](auto tag) {
    using T = decltype(tag);
    DispatchRows<kMaxRowDotRows>(rows, [&](auto row_count) {
      AccumulateValuesTyped<T, decltype(row_count)::value>(p, ld_p, keys, static_cast<const T*>(value), ld_value,
                                                           width, acc, ld_acc, static_cast<const T*>(next));
    });
    return 0;
  });
}

#if defined(TOKAMAX_TIER_AVX512BF16)
inline __m512bh LoadBf16(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

// st[k * ld_st + r] = scale * key[k] · q[r] for kKeys keys and kRows rows: 32 elements of h per
// step, q's kRows vectors loaded once per step and shared by the keys, each (key, row) pair's
// 16 lane sums reduced by SumLanes. The order of every sum depends on depth only.
template <int64_t kRows, int64_t kKeys>
[[gnu::always_inline]] inline void KeyDotsBf16Group(const uint16_t* key, int64_t ld_key, int64_t depth,
                                                    const uint16_t* q, int64_t ld_q, float scale, float* st,
                                                    int64_t ld_st, const uint16_t* next) {
  constexpr int64_t kAccumulators = RoundUp(kRows * kKeys, kLanes);
  Vec acc[kAccumulators];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kAccumulators; ++i) acc[i] = Set1(0.0f);
  for (int64_t h = 0; h < depth; h += 32) {
    __m512bh qv[kRows];
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) qv[r] = LoadBf16(q + r * ld_q + h);
#pragma GCC unroll 16
    for (int64_t k = 0; k < kKeys; ++k) {
      const __m512bh kv = LoadBf16(key + k * ld_key + h);
      if (next != nullptr) PrefetchToL2(next + k * ld_key + h);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kRows; ++r) acc[k * kRows + r] = _mm512_dpbf16_ps(acc[k * kRows + r], kv, qv[r]);
    }
  }
  float sums[kAccumulators];
  const Vec s = Set1(scale);
#pragma GCC unroll 16
  for (int64_t i = 0; i < kAccumulators; i += kLanes) Store(sums + i, Mul(s, SumLanes(acc + i)));
#pragma GCC unroll 16
  for (int64_t k = 0; k < kKeys; ++k) {
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) st[k * ld_st + r] = sums[k * kRows + r];
  }
}

void KeyDotsBf16(const uint16_t* key, int64_t ld_key, int64_t keys, int64_t depth, const uint16_t* q, int64_t ld_q,
                 int64_t rows, float scale, float* st, int64_t ld_st, const uint16_t* next) {
  if (rows <= 0) return;
  DispatchRows<kMaxRowDotRows>(rows, [&](auto row_count) {
    constexpr int64_t kRows = decltype(row_count)::value;
    constexpr int64_t kKeys = kLanes / kRows > 1 ? kLanes / kRows : 1;
    int64_t j = 0;
    for (; j + kKeys <= keys; j += kKeys) {
      KeyDotsBf16Group<kRows, kKeys>(key + j * ld_key, ld_key, depth, q, ld_q, scale, st + j * ld_st, ld_st,
                                     next == nullptr ? nullptr : next + j * ld_key);
    }
    for (; j < keys; ++j) {
      KeyDotsBf16Group<kRows, 1>(key + j * ld_key, ld_key, depth, q, ld_q, scale, st + j * ld_st, ld_st,
                                 next == nullptr ? nullptr : next + j * ld_key);
    }
  });
}

// The accumulator of 32 columns as the dot instruction produces it: unpacking two value rows
// by 16-bit pairs interleaves within 128-bit lanes, so `lo` holds columns 0-3, 8-11, 16-19,
// 24-27 and `hi` columns 4-7, 12-15, 20-23, 28-31. These convert from and to the natural order.
inline void ToPairOrder(Vec n0, Vec n1, Vec* lo, Vec* hi) {
  *lo = _mm512_shuffle_f32x4(n0, n1, 0x88);
  *hi = _mm512_shuffle_f32x4(n0, n1, 0xDD);
}
inline void FromPairOrder(Vec lo, Vec hi, Vec* n0, Vec* n1) {
  const Vec t0 = _mm512_shuffle_f32x4(lo, hi, 0x44), t1 = _mm512_shuffle_f32x4(lo, hi, 0xEE);
  *n0 = _mm512_shuffle_f32x4(t0, t0, 0xD8);
  *n1 = _mm512_shuffle_f32x4(t1, t1, 0xD8);
}

// acc[r][e0 + e] += sum_j bf16(p[j][r]) · value[j][e0 + e] for e < 32 * kBlocks: two keys per
// step, each row's two weights one 32-bit broadcast, the two value rows interleaved into
// pairs by one unpack per 16 columns. `weights` holds the pairs: [key pair][row] as 32 bits.
template <int64_t kRows, int64_t kBlocks>
[[gnu::always_inline]] inline void AccumulateValuesBf16Block(const uint32_t* weights, int64_t keys,
                                                             const uint16_t* value, int64_t ld_value, int64_t e0,
                                                             float* acc, int64_t ld_acc, const uint16_t* next) {
  Vec lo[kRows][kBlocks], hi[kRows][kBlocks];
#pragma GCC unroll 16
  for (int64_t r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
    for (int64_t b = 0; b < kBlocks; ++b) {
      const float* a = acc + r * ld_acc + e0 + 32 * b;
      ToPairOrder(Load(a), Load(a + 16), &lo[r][b], &hi[r][b]);
    }
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < keys; j += 2) {
    __m512bh vlo[kBlocks], vhi[kBlocks];
#pragma GCC unroll 16
    for (int64_t b = 0; b < kBlocks; ++b) {
      const uint16_t* row = value + j * ld_value + e0 + 32 * b;
      const __m512i v0 = _mm512_loadu_si512(row);
      const __m512i v1 = j + 1 < keys ? _mm512_loadu_si512(row + ld_value) : zero;
      if (next != nullptr) {
        PrefetchToL2(next + j * ld_value + e0 + 32 * b);
        if (j + 1 < keys) PrefetchToL2(next + (j + 1) * ld_value + e0 + 32 * b);
      }
      vlo[b] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(v0, v1));
      vhi[b] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(v0, v1));
    }
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(weights[(j / 2) * kRows + r])));
#pragma GCC unroll 16
      for (int64_t b = 0; b < kBlocks; ++b) {
        lo[r][b] = _mm512_dpbf16_ps(lo[r][b], w, vlo[b]);
        hi[r][b] = _mm512_dpbf16_ps(hi[r][b], w, vhi[b]);
      }
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
    for (int64_t b = 0; b < kBlocks; ++b) {
      Vec n0, n1;
      FromPairOrder(lo[r][b], hi[r][b], &n0, &n1);
      float* a = acc + r * ld_acc + e0 + 32 * b;
      Store(a, n0);
      Store(a + 16, n1);
    }
  }
}

// At most kMaxKeysPerCall keys at a time (the decode path's runs are 16): the weights are
// rounded once, then the columns go in blocks of 8 / kRows x 32.
constexpr int64_t kMaxKeysPerCall = 64;

void AccumulateValuesBf16(const float* p, int64_t ld_p, int64_t keys, int64_t rows, const uint16_t* value,
                          int64_t ld_value, int64_t width, float* acc, int64_t ld_acc, const uint16_t* next) {
  if (rows <= 0 || keys <= 0) return;
  for (int64_t j0 = 0; j0 < keys; j0 += kMaxKeysPerCall) {
    const int64_t n = std::min(kMaxKeysPerCall, keys - j0);
    DispatchRows<kMaxRowDotRows>(rows, [&](auto row_count) {
      constexpr int64_t kRows = decltype(row_count)::value;
      // weights[pair][r] = (bf16(p[2 pair][r]), bf16(p[2 pair + 1][r])), nearest even (as
      // FloatToBFloat16), a missing odd key 0: two keys' rows converted by one cvtne2ps and
      // interleaved into 32-bit pairs by one vpermw.
      alignas(64) uint32_t weights[kMaxKeysPerCall / 2 * kRows];
      const __mmask16 row_mask = static_cast<__mmask16>((1u << kRows) - 1);
      const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                  7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      for (int64_t j = 0; j < n; j += 2) {
        const Vec even = _mm512_maskz_loadu_ps(row_mask, p + (j0 + j) * ld_p);
        const Vec odd = j + 1 < n ? _mm512_maskz_loadu_ps(row_mask, p + (j0 + j + 1) * ld_p) : Set1(0.0f);
        const __m512i rounded = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
        const __m512i pairs = _mm512_permutexvar_epi16(interleave, rounded);
        _mm512_mask_storeu_epi32(weights + (j / 2) * kRows, row_mask, pairs);
      }
      constexpr int64_t kBlocks = 8 / kRows > 1 ? 8 / kRows : 1;
      const uint16_t* v = value + j0 * ld_value;
      const uint16_t* next_v = next == nullptr ? nullptr : next + j0 * ld_value;
      int64_t e0 = 0;
      for (; e0 + 32 * kBlocks <= width; e0 += 32 * kBlocks) {
        AccumulateValuesBf16Block<kRows, kBlocks>(weights, n, v, ld_value, e0, acc, ld_acc, next_v);
      }
      for (; e0 < width; e0 += 32) {
        AccumulateValuesBf16Block<kRows, 1>(weights, n, v, ld_value, e0, acc, ld_acc, next_v);
      }
    });
  }
}

#endif  // TOKAMAX_TIER_AVX512BF16

}  // namespace row_products

const attention::RowProducts& RowProductsTable() {
  using namespace row_products;
  static const attention::RowProducts table = [] {
    attention::RowProducts t{};
    t.key_dots = &KeyDots;
    t.accumulate_values = &AccumulateValues;
#if defined(TOKAMAX_TIER_AVX512BF16)
    t.key_dots_bf16 = &KeyDotsBf16;
    t.accumulate_values_bf16 = &AccumulateValuesBf16;
#endif
    return t;
  }();
  return table;
}

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
