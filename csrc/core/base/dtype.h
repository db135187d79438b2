// Element types the kernels read and write, and scalar conversions to and from fp32.
// bf16 and fp16 are stored as raw uint16_t bit patterns so the core needs no torch types.
// The helpers are `static`: every ISA translation unit gets its own copy compiled with its own
// flags, so the linker can never hand an AVX-512 copy to code running on an AVX2-only CPU.
#pragma once

#include <cstdint>
#include <cstring>

namespace tokamax {

// kFloat64 is served by plain double-precision loops (for gradcheck and oracles), not by the
// packed fp32 GEMM.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat64 = 3 };

static inline const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kFloat64: return "float64";
  }
  return "unknown";
}

static inline int64_t DTypeSize(DType dtype) {
  return dtype == DType::kFloat64 ? 8 : (dtype == DType::kFloat32 ? 4 : 2);
}

static inline float BitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

static inline uint32_t FloatToBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

static inline float BFloat16ToFloat(uint16_t bits) { return BitsToFloat(uint32_t{bits} << 16); }

// Round to nearest even; NaN stays a (quiet) NaN instead of rounding up into infinity.
static inline uint16_t FloatToBFloat16(float value) {
  const uint32_t bits = FloatToBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

// IEEE binary16 -> binary32, exact (subnormals, infinities and NaN included).
static inline float HalfToFloat(uint16_t half) {
  const uint32_t sign = uint32_t{half & 0x8000u} << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return BitsToFloat(sign);
  // Subnormal half: normalise into a float.
  int shift = 0;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  mantissa &= 0x3ffu;
  return BitsToFloat(sign | ((113u - shift) << 23) | (mantissa << 13));
}

// IEEE binary32 -> binary16 with round to nearest even, overflow to infinity.
static inline uint16_t FloatToHalf(float value) {
  const uint32_t bits = FloatToBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs_bits >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (abs_bits < 0x38800000u) {
    // Result is subnormal (or zero): value * 2^24 rounded to an integer, nearest even.
    if (abs_bits < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t exponent = abs_bits >> 23;
    const uint32_t mantissa = (abs_bits & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    const uint32_t truncated = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t rounded = truncated;
    if (remainder > halfway || (remainder == halfway && (truncated & 1u))) ++rounded;
    return static_cast<uint16_t>(sign | rounded);
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits.
  const uint32_t rebased = abs_bits - (112u << 23);
  const uint32_t rounding_bias = 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rebased + rounding_bias) >> 13));
}

template <typename T>
static inline float LoadAsFloat(const T* ptr);
template <>
inline float LoadAsFloat<float>(const float* ptr) { return *ptr; }

struct BFloat16Bits { uint16_t bits; };
struct Float16Bits { uint16_t bits; };

template <>
inline float LoadAsFloat<BFloat16Bits>(const BFloat16Bits* ptr) { return BFloat16ToFloat(ptr->bits); }
template <>
inline float LoadAsFloat<Float16Bits>(const Float16Bits* ptr) { return HalfToFloat(ptr->bits); }

template <>
inline float LoadAsFloat<double>(const double* ptr) { return static_cast<float>(*ptr); }

static inline void StoreFromFloat(float* ptr, float value) { *ptr = value; }
static inline void StoreFromFloat(double* ptr, float value) { *ptr = value; }
static inline void StoreFromFloat(BFloat16Bits* ptr, float value) { ptr->bits = FloatToBFloat16(value); }
static inline void StoreFromFloat(Float16Bits* ptr, float value) { ptr->bits = FloatToHalf(value); }

// Calls fn(T{}) with T the storage type of `dtype`: float, BFloat16Bits, Float16Bits or double.
template <typename Fn>
static inline auto DispatchDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBFloat16: return fn(BFloat16Bits{});
    case DType::kFloat16: return fn(Float16Bits{});
    case DType::kFloat64: return fn(double{});
    case DType::kFloat32: break;
  }
  return fn(float{});
}

}  // namespace tokamax
