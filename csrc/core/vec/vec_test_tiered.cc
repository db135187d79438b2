// The vector layer (vec.h) on every tier this build has, against the scalar definitions: each
// primitive on values that exercise its edges (tails, NaN, infinities, rounding ties,
// subnormals). Compiled once per tier; a tier the CPU lacks skips.
// tokamax-tiers: scalar avx2 avx512 avx512bf16 amx
#include "csrc/core/vec/vec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/runtime/isa.h"

#define TOKAMAX_VEC_CAT2(a, b) a##_##b
#define TOKAMAX_VEC_CAT(a, b) TOKAMAX_VEC_CAT2(a, b)
#define TOKAMAX_VEC_SUITE TOKAMAX_VEC_CAT(VecTest, TOKAMAX_TIER_NAMESPACE)

namespace tokamax {
namespace TOKAMAX_TIER_NAMESPACE {
namespace {

#if defined(TOKAMAX_TIER_SCALAR)
constexpr Isa kIsa = Isa::kScalar;
#elif defined(TOKAMAX_TIER_AVX2)
constexpr Isa kIsa = Isa::kAvx2;
#elif defined(TOKAMAX_TIER_AVX512)
constexpr Isa kIsa = Isa::kAvx512;
#elif defined(TOKAMAX_TIER_AVX512BF16)
constexpr Isa kIsa = Isa::kAvx512Bf16;
#else
constexpr Isa kIsa = Isa::kAmx;
#endif

#define TOKAMAX_SKIP_UNSUPPORTED() \
  if (!IsaSupported(kIsa, GetCpuInfo())) GTEST_SKIP() << IsaName(kIsa) << " not supported here"

constexpr float kInf = std::numeric_limits<float>::infinity();

float BitsToFloatValue(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Values that stress the conversions: ties at both precisions, subnormals, overflow, NaNs.
std::vector<float> EdgeValues() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.5f, kInf, -kInf, 65504.0f, 65519.0f, 65520.0f, 1e-8f, -3e-6f,
                          6.0e-8f, 3.0e-8f, 1e-40f, 3.4e38f,
                          BitsToFloatValue(0x3f808000u),   // bf16 tie, even below: rounds down
                          BitsToFloatValue(0x3f818000u),   // bf16 tie, odd below: rounds up
                          BitsToFloatValue(0x3f800fffu),   // fp16: just below a tie
                          BitsToFloatValue(0x7fc00001u),   // quiet NaN with payload
                          BitsToFloatValue(0xff800001u),   // signalling NaN, negative
                          BitsToFloatValue(0x7f800100u)};  // NaN whose payload sits in the low bits
  for (int i = 0; i < 45; ++i) v.push_back(std::sin(0.7f * i) * std::pow(2.0f, static_cast<float>(i % 30 - 15)));
  while (v.size() % 16 != 0) v.push_back(static_cast<float>(v.size()) * 0.1f);
  return v;
}

TEST(TOKAMAX_VEC_SUITE, PartialLoadsZeroTheRestAndPartialStoresTouchNothingElse) {
  TOKAMAX_SKIP_UNSUPPORTED();
  std::vector<float> src(kLanes), dst(kLanes);
  for (int64_t l = 0; l < kLanes; ++l) src[l] = 1.0f + l;
  for (int64_t n = 0; n < kLanes; ++n) {
    float lanes[kLanes];
    Store(lanes, LoadPartial(src.data(), n));
    for (int64_t l = 0; l < kLanes; ++l) EXPECT_EQ(lanes[l], l < n ? src[l] : 0.0f) << "n " << n;
    std::fill(dst.begin(), dst.end(), -7.0f);
    StorePartial(dst.data(), Load(src.data()), n);
    for (int64_t l = 0; l < kLanes; ++l) EXPECT_EQ(dst[l], l < n ? src[l] : -7.0f) << "n " << n;
  }
}

TEST(TOKAMAX_VEC_SUITE, NarrowingIsBitwiseTheScalarConversion) {
  TOKAMAX_SKIP_UNSUPPORTED();
  const std::vector<float> values = EdgeValues();
  for (size_t i = 0; i < values.size(); i += kLanes) {
    const Vec v = Load(values.data() + i);
    BFloat16Bits bf[kLanes];
    Float16Bits half[kLanes];
    StoreNarrow(bf, v);
    StoreNarrow(half, v);
    for (int64_t l = 0; l < kLanes; ++l) {
      BFloat16Bits want_bf;
      Float16Bits want_half;
      StoreFromFloat(&want_bf, values[i + l]);
      StoreFromFloat(&want_half, values[i + l]);
      EXPECT_EQ(bf[l].bits, want_bf.bits) << "bf16 of value " << i + l;
      EXPECT_EQ(half[l].bits, want_half.bits) << "fp16 of value " << i + l;
    }
  }
}

TEST(TOKAMAX_VEC_SUITE, WideningIsExact) {
  TOKAMAX_SKIP_UNSUPPORTED();
  std::vector<BFloat16Bits> bf(64);
  std::vector<Float16Bits> half(64);
  std::vector<double> wide(64);
  for (int i = 0; i < 64; ++i) {
    bf[i].bits = static_cast<uint16_t>(0x3f00 + 997 * i);
    half[i].bits = static_cast<uint16_t>(0x0001 + 1021 * i);  // subnormals through NaNs
    wide[i] = 1.0 / (i + 3);
  }
  for (int64_t i = 0; i + kLanes <= 64; i += kLanes) {
    float got_bf[kLanes], got_half[kLanes], got_wide[kLanes], got_partial[kLanes];
    Store(got_bf, LoadWiden(bf.data() + i));
    Store(got_half, LoadWiden(half.data() + i));
    Store(got_wide, LoadWiden(wide.data() + i));
    Store(got_partial, LoadWidenPartial(half.data() + i, kLanes - 1));
    for (int64_t l = 0; l < kLanes; ++l) {
      const float want_bf = LoadAsFloat(&bf[i + l]), want_half = LoadAsFloat(&half[i + l]);
      EXPECT_TRUE(got_bf[l] == want_bf || (std::isnan(got_bf[l]) && std::isnan(want_bf))) << i + l;
      EXPECT_TRUE(got_half[l] == want_half || (std::isnan(got_half[l]) && std::isnan(want_half))) << i + l;
      EXPECT_EQ(got_wide[l], static_cast<float>(wide[i + l]));
      if (l + 1 < kLanes) {
        EXPECT_TRUE(got_partial[l] == want_half || (std::isnan(got_partial[l]) && std::isnan(want_half)));
      } else {
        EXPECT_EQ(got_partial[l], 0.0f);
      }
    }
  }
}

// Tails: every count of every element type, with guards on both sides of the destination.
template <typename T>
void ExpectPartialWideningAndNarrowingMatchScalar() {
  const std::vector<float> values = EdgeValues();
  std::vector<T> src(kLanes);
  for (int64_t l = 0; l < kLanes; ++l) StoreFromFloat(&src[l], values[(7 * l + 3) % values.size()]);
  for (int64_t n = 0; n < kLanes; ++n) {
    float got[kLanes];
    Store(got, LoadWidenPartial(src.data(), n));
    for (int64_t l = 0; l < kLanes; ++l) {
      const float want = l < n ? LoadAsFloat(&src[l]) : 0.0f;
      EXPECT_TRUE(got[l] == want || (std::isnan(got[l]) && std::isnan(want))) << "n " << n << " lane " << l;
    }
    std::vector<T> dst(kLanes + 2), guard(kLanes + 2);
    for (auto* buffer : {&dst, &guard}) {
      for (int64_t l = 0; l < kLanes + 2; ++l) StoreFromFloat(&(*buffer)[l], -7.0f);
    }
    StoreNarrowPartial(dst.data() + 1, Load(values.data()), n);
    for (int64_t l = 0; l < kLanes + 2; ++l) {
      T want = guard[l];
      if (l >= 1 && l <= n) StoreFromFloat(&want, values[l - 1]);
      EXPECT_EQ(std::memcmp(&dst[l], &want, sizeof(T)), 0) << "n " << n << " element " << l;
    }
  }
}

TEST(TOKAMAX_VEC_SUITE, PartialWideningAndNarrowingMatchTheScalarConversions) {
  TOKAMAX_SKIP_UNSUPPORTED();
  ExpectPartialWideningAndNarrowingMatchScalar<float>();
  ExpectPartialWideningAndNarrowingMatchScalar<BFloat16Bits>();
  ExpectPartialWideningAndNarrowingMatchScalar<Float16Bits>();
  ExpectPartialWideningAndNarrowingMatchScalar<double>();
}

TEST(TOKAMAX_VEC_SUITE, ExpIsAccurateAndFlushesBelowTheCutoff) {
  TOKAMAX_SKIP_UNSUPPORTED();
  std::vector<float> x;
  for (int i = 0; i < 16 * 40; ++i) x.push_back(-90.0f + 0.28f * i);  // -90 .. 89
  x.push_back(-kInf);
  // NaN stays NaN: a NaN logit must not pass for a masked one (attention's output and lse).
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  x.push_back(-std::numeric_limits<float>::quiet_NaN());
  while (x.size() % 16 != 0) x.push_back(0.0f);
  for (size_t i = 0; i < x.size(); i += kLanes) {
    float got[kLanes];
    Store(got, Exp(Load(x.data() + i)));
    for (int64_t l = 0; l < kLanes; ++l) {
      const float xi = x[i + l];
      if (std::isnan(xi)) {
        EXPECT_TRUE(std::isnan(got[l])) << "exp(NaN) gave " << got[l];
      } else if (xi < kExpFlushBelow) {
        EXPECT_EQ(got[l], 0.0f) << "x " << xi;
      } else if (xi <= 88.0f) {
        const double want = std::exp(static_cast<double>(xi));
        EXPECT_NEAR(got[l], want, 4e-7 * want) << "x " << xi;
      }
    }
  }
}

// Units in the last place of float at v (the spacing above |v|; the smallest normal's below it).
double UlpAt(double v) {
  const float f = std::max(static_cast<float>(std::fabs(v)), std::numeric_limits<float>::min());
  return static_cast<double>(std::nextafter(f, kInf) - f);
}

TEST(TOKAMAX_VEC_SUITE, TanhAndItsSlopeAreAccurateIncludingDeepSaturation) {
  TOKAMAX_SKIP_UNSUPPORTED();
  std::vector<float> x;
  for (int i = 0; i <= 4000; ++i) x.push_back(-20.0f + 0.01f * i);       // both branches and the switch at 0.5
  for (int i = 0; i <= 200; ++i) x.push_back(0.49f + 0.0001f * i);       // around the switch
  for (int e = -40; e <= 6; ++e) x.push_back(std::ldexp(1.37f, e));      // tiny to large
  for (float v : {50.0f, 88.0f, 100.0f, 1e30f, kInf, -kInf, 0.0f, -0.0f}) x.push_back(v);
  while (x.size() % 16 != 0) x.push_back(0.25f);
  for (size_t i = 0; i < x.size(); i += kLanes) {
    float t[kLanes], s[kLanes], t_only[kLanes];
    Vec slope;
    Store(t, Tanh(Load(x.data() + i), &slope));
    Store(s, slope);
    Store(t_only, Tanh(Load(x.data() + i), nullptr));
    for (int64_t l = 0; l < kLanes; ++l) {
      const double xi = x[i + l], want_t = std::tanh(xi), c = std::cosh(xi), want_s = 1.0 / (c * c);
      EXPECT_EQ(t_only[l], t[l]) << "x " << xi;  // the slope does not change tanh's bits
      EXPECT_LE(std::fabs(t[l] - want_t), 4 * UlpAt(want_t)) << "x " << xi;
      EXPECT_EQ(std::signbit(t[l]), std::signbit(xi)) << "x " << xi;  // odd, -0 included
      // The slope relative to itself, however small (the point of computing it apart from tanh),
      // down to where exp(-2|x|) flushes (below 1e-37): 0 there, or a subnormal.
      if (-2.0 * std::fabs(xi) >= kExpFlushBelow) {
        EXPECT_LE(std::fabs(s[l] - want_s), 8 * UlpAt(want_s)) << "x " << xi;
      } else {
        EXPECT_LE(s[l], 4e-37f) << "x " << xi;
        EXPECT_GE(s[l], 0.0f) << "x " << xi;
      }
    }
  }
  float nan_in[kLanes], nan_t[kLanes], nan_s[kLanes];
  std::fill(nan_in, nan_in + kLanes, std::numeric_limits<float>::quiet_NaN());
  Vec nan_slope;
  Store(nan_t, Tanh(Load(nan_in), &nan_slope));
  Store(nan_s, nan_slope);
  for (int64_t l = 0; l < kLanes; ++l) {
    EXPECT_TRUE(std::isnan(nan_t[l]));
    EXPECT_TRUE(std::isnan(nan_s[l]));
  }
}

TEST(TOKAMAX_VEC_SUITE, ReductionsAndLaneSums) {
  TOKAMAX_SKIP_UNSUPPORTED();
  std::vector<float> v(kLanes * kLanes);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 37) % 101) - 50.0f;  // exact sums
  Vec rows[kLanes];
  for (int64_t r = 0; r < kLanes; ++r) rows[r] = Load(v.data() + r * kLanes);
  float sums[kLanes];
  Store(sums, SumLanes(rows));
  for (int64_t r = 0; r < kLanes; ++r) {
    float want = 0.0f, want_max = -kInf;
    for (int64_t l = 0; l < kLanes; ++l) {
      want += v[r * kLanes + l];
      want_max = std::max(want_max, v[r * kLanes + l]);
    }
    EXPECT_EQ(sums[r], want) << "row " << r;
    EXPECT_EQ(ReduceAdd(rows[r]), want) << "row " << r;
    EXPECT_EQ(ReduceMax(rows[r]), want_max) << "row " << r;
  }
}

TEST(TOKAMAX_VEC_SUITE, ArithmeticRangeMaskAndTransposes) {
  TOKAMAX_SKIP_UNSUPPORTED();
  float a[kLanes], b[kLanes], out[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) {
    a[l] = 1.5f * l - 3.0f;
    b[l] = 2.0f - 0.25f * l;
  }
  const Vec va = Load(a), vb = Load(b);
  // FmaBroadcast's operand lives on the heap, as the GEMM panels it reads do: GCC 12's
  // AddressSanitizer with detect_stack_use_after_return miscompiles a function whose inline asm
  // takes a stack variable as a memory operand (the frame base it loads earlier arrays from is
  // wrong; a 20-line program reproduces it).
  const std::vector<float> broadcast(1, 0.5f);
  const float c = broadcast[0];
  auto check = [&](Vec got, auto want, const char* what) {
    Store(out, got);
    for (int64_t l = 0; l < kLanes; ++l) EXPECT_EQ(out[l], want(a[l], b[l])) << what << " lane " << l;
  };
  check(Add(va, vb), [](float x, float y) { return x + y; }, "Add");
  check(Sub(va, vb), [](float x, float y) { return x - y; }, "Sub");
  check(Mul(va, vb), [](float x, float y) { return x * y; }, "Mul");
  check(Min(va, vb), [](float x, float y) { return std::min(x, y); }, "Min");
  check(Max(va, vb), [](float x, float y) { return std::max(x, y); }, "Max");
  check(Fma(va, vb, Set1(c)), [&](float x, float y) { return std::fma(x, y, c); }, "Fma");
  check(FmaBroadcast(broadcast.data(), va, vb), [&](float x, float y) { return std::fma(c, x, y); }, "FmaBroadcast");
  // InRange(x, r, lo, hi): lanes with lo <= r < hi keep x.
  check(InRange(va, Set1(1.0f), vb, Set1(2.5f)),
        [](float x, float y) { return y <= 1.0f && 1.0f < 2.5f ? x : -kInf; }, "InRange");
  // GreaterMask: one bit per lane where a > b; a NaN lane never sets its bit.
  float with_nan[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) with_nan[l] = l % 3 == 2 ? std::nanf("") : a[l];
  const uint32_t mask = GreaterMask(Load(with_nan), vb);
  for (int64_t l = 0; l < kLanes; ++l) {
    EXPECT_EQ((mask >> l) & 1u, with_nan[l] > b[l] ? 1u : 0u) << "GreaterMask lane " << l;
  }
  EXPECT_EQ(mask >> kLanes, 0u) << "GreaterMask sets no bit past the lanes";
  float src[8 * 8], dst[8 * 8];
  for (int i = 0; i < 64; ++i) src[i] = static_cast<float>(i);
  Transpose8x8(src, 8, dst, 8);
  for (int j = 0; j < 8; ++j) {
    for (int l = 0; l < 8; ++l) EXPECT_EQ(dst[l * 8 + j], src[j * 8 + l]);
  }
  std::fill(dst, dst + 64, -1.0f);
  Transpose4x8(src, 8, dst, 8);
  for (int l = 0; l < 8; ++l) {
    for (int j = 0; j < 8; ++j) EXPECT_EQ(dst[l * 8 + j], j < 4 ? src[j * 8 + l] : -1.0f);
  }
}

}  // namespace
}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
