// The vector layer: one small set of fp32 vector primitives per ISA tier that a kernel family
// is written against once. A tiered source (`*_tiered.cc`, see CMakeLists.txt's
// tokamax_tier_sources) is compiled once per tier it lists, each time with that tier's flags,
// TOKAMAX_TIER_<NAME> and TOKAMAX_TIER_NAMESPACE (tier_scalar, tier_avx2, ...) defined; this
// header then declares, inside namespace tokamax::TOKAMAX_TIER_NAMESPACE:
//
//   Vec, kLanes (1, 8 or 16; 16 is divisible by it), kAccumulatorRegisters (vectors a product
//     may keep in registers)
//   Load/Store(p), LoadPartial/StorePartial(p, n) (the first n < kLanes lanes; loads zero the
//     rest, stores leave memory past n untouched), Set1, Zero
//   Add, Sub, Mul, Div, Min, Max, Fma(a, b, c) = a·b + c, FmaBroadcast(const float* a, b, c) = *a·b + c
//   Exp (flushes below kExpFlushBelow to exactly 0, NaN stays NaN; the same polynomial on every
//     SIMD tier)
//   InRange(x, r, lo, hi): x where lo <= r < hi lane by lane, -inf elsewhere
//   GreaterMask(a, b): bit l set where a[l] > b[l] (ordered: never for a NaN lane)
//   Abs(v), CopySign(magnitude, sign), IfAtLeast(a, b, then, otherwise): `then` where a >= b
//     lane by lane, `otherwise` elsewhere (ordered: a NaN lane takes `otherwise`)
//   Tanh(x, slope) (shared, below: tanh and its derivative to a few ulp)
//   ReduceAdd/ReduceMax(v) (one fixed order), SumLanes(v) (lane i = the sum of v[i]'s lanes,
//     for kLanes vectors)
//   LoadWiden(p) (kLanes float, BFloat16Bits, Float16Bits or double elements as fp32 lanes),
//   LoadWidenPartial(p, n), StoreNarrow(p, v) (fp32 lanes to float, BFloat16Bits, Float16Bits or
//     double, round to nearest even, NaN kept NaN: the bits of StoreFromFloat), StoreNarrowPartial(p, v, n)
//   StreamNarrow(p, v) (StoreNarrow's bits with a non-temporal store, past the caches: for
//     outputs too large to be read back from them; p aligned to kLanes elements), and
//     StreamFence() (orders the streamed stores before later ones: before a task ends)
//   StreamAligned(p), WithNarrowStore(stream, body) (body's loop with StreamNarrow or StoreNarrow)
//   Transpose8x8 / Transpose4x8(src, ld_src, dst, ld_dst): dst[l][j] = src[j][l], l < 8
//   PrefetchToL2(p) (a hint; none on the scalar tier)
//
// Every tier gives the same results as the scalar tier up to the order of sums (fixed per
// tier) and exp's last bits, so results are bitwise reproducible per tier. The code lives in
// the tier's namespace because every tier's copy of an inline function must stay apart: the
// linker would otherwise keep one copy, compiled with one tier's flags, for all of them.
#pragma once

#if !defined(TOKAMAX_TIER_NAMESPACE)
#error "csrc/core/vec/vec.h is for tiered sources (*_tiered.cc), compiled once per tier by CMake"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "csrc/core/base/dtype.h"
#include "csrc/core/base/int_math.h"

#if !defined(TOKAMAX_TIER_SCALAR)
#include <immintrin.h>
#endif

namespace tokamax {

// Inputs below this give exp() == 0 exactly (masked logits are -inf); every tier flushes here.
constexpr float kExpFlushBelow = -87.0f;

namespace TOKAMAX_TIER_NAMESPACE {

#if defined(TOKAMAX_TIER_SCALAR)
#include "csrc/core/vec/vec_scalar.inc"
#elif defined(TOKAMAX_TIER_AVX2)
#include "csrc/core/vec/vec_avx2.inc"
#elif defined(TOKAMAX_TIER_AVX512) || defined(TOKAMAX_TIER_AVX512BF16) || defined(TOKAMAX_TIER_AMX)
#include "csrc/core/vec/vec_avx512.inc"
#else
#error "unknown tier"
#endif

// Shared by every tier: defined on the primitives above.
inline Vec Zero() { return Set1(0.0f); }

// tanh(x), and when `slope` is not null its derivative 1 - tanh²(x) there, within 4 and 8 ulp of
// the exact values on every SIMD tier (the scalar tier: the C library's tanh and 1 / cosh²). From
// |x| = 0.5 on, with f = exp(-2|x|): tanh = (1 - f) / (1 + f) and 1 - tanh² = 4f / (1 + f)², both
// free of cancellation (1 - tanh² taken from tanh loses all its digits as tanh saturates); f
// flushes to 0 past |x| = 43.5 (Exp's cutoff), giving ±1 and a slope of 0 (exactly: below 4e-37),
// ±inf included. Below 0.5 the odd Taylor series to x^15 (the next term is 1e-8 of tanh there).
// NaN stays NaN.
inline Vec Tanh(Vec x, Vec* slope) {
#if defined(TOKAMAX_TIER_SCALAR)
  if (slope != nullptr) {
    const float c = std::cosh(x);  // inf past |x| ~ 89 (c * c past ~ 44): a slope of 0
    *slope = 1.0f / (c * c);
  }
  return std::tanh(x);
#else
  const Vec one = Set1(1.0f), y = Abs(x), f = Exp(Mul(Set1(-2.0f), y)), one_plus_f = Add(one, f);
  const Vec z = Mul(y, y);
  Vec p = Set1(-929569.0f / 638512875.0f);
  p = Fma(p, z, Set1(21844.0f / 6081075.0f));
  p = Fma(p, z, Set1(-1382.0f / 155925.0f));
  p = Fma(p, z, Set1(62.0f / 2835.0f));
  p = Fma(p, z, Set1(-17.0f / 315.0f));
  p = Fma(p, z, Set1(2.0f / 15.0f));
  p = Fma(p, z, Set1(-1.0f / 3.0f));
  const Vec series = Fma(Mul(p, z), y, y);
  const Vec half = Set1(0.5f);
  if (slope != nullptr) {
    *slope = IfAtLeast(y, half, Div(Mul(Set1(4.0f), f), Mul(one_plus_f, one_plus_f)), Sub(one, Mul(series, series)));
  }
  return CopySign(IfAtLeast(y, half, Div(Sub(one, f), one_plus_f), series), x);
#endif
}

// Whether p is aligned for StreamNarrow.
template <typename T>
inline bool StreamAligned(const T* p) { return reinterpret_cast<uintptr_t>(p) % (kLanes * sizeof(T)) == 0; }

// body(store) with store(p, v) = StreamNarrow (stream: outputs too large to be read back from the
// caches, every pointer StreamAligned) or StoreNarrow: one loop body, two instantiations.
template <typename Body>
inline void WithNarrowStore(bool stream, const Body& body) {
  if (stream) {
    body([](auto* p, Vec v) { StreamNarrow(p, v); });
  } else {
    body([](auto* p, Vec v) { StoreNarrow(p, v); });
  }
}

#if !defined(TOKAMAX_VEC_OWN_WIDENING)
// Tiers of at most 32-byte vectors widen double rows and tails through a stack array. The
// AVX-512 tier defines its own without one: GCC 12's AddressSanitizer places a function's frame
// on its fake stack (detect_stack_use_after_return) 32-byte aligned, while the vectorizer may
// raise a 64-byte local array to 64 and store to it with vmovdqa64, which then faults.

// double rows (the reference dtype, never on a hot path) widen lane by lane.
inline Vec LoadWiden(const double* p) {
  float lanes[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = static_cast<float>(p[l]);
  return Load(lanes);
}

// The first `count` (< kLanes) elements as fp32 lanes, the rest zero: tails.
template <typename T>
inline Vec LoadWidenPartial(const T* p, int64_t count) {
  float lanes[kLanes] = {};
  for (int64_t l = 0; l < count; ++l) lanes[l] = LoadAsFloat(p + l);
  return Load(lanes);
}

inline void StoreNarrow(double* p, Vec v) {
  float lanes[kLanes];
  Store(lanes, v);
  for (int64_t l = 0; l < kLanes; ++l) p[l] = lanes[l];
}

// StoreNarrow's bits for the first `count` (< kLanes) lanes; memory past them is untouched.
template <typename T>
inline void StoreNarrowPartial(T* p, Vec v, int64_t count) {
  float lanes[kLanes];
  Store(lanes, v);
  for (int64_t l = 0; l < count; ++l) StoreFromFloat(p + l, lanes[l]);
}
#endif

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
