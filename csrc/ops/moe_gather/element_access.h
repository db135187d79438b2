// Element loads and stores the MoE kernels (moe_gather, fused_moe) share: fp32 arithmetic on
// fp32 / bf16 / fp16 storage, float64 on float64, and one element of a view of any float dtype.
#pragma once

#include <type_traits>

#include "csrc/core/base/dtype.h"

namespace tokamax::moe {

// fp32 accumulation, float64 for float64 storage.
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <typename T>
constexpr DType kAccDType = std::is_same_v<T, double> ? DType::kFloat64 : DType::kFloat32;

template <typename T>
inline Acc<T> Load(const T* p) {
  if constexpr (std::is_same_v<T, double>) {
    return *p;
  } else {
    return LoadAsFloat(p);
  }
}

template <typename T, typename V>
inline void Store(T* p, V v) {
  if constexpr (std::is_same_v<T, double>) {
    *p = static_cast<double>(v);
  } else {
    StoreFromFloat(p, static_cast<float>(v));
  }
}

// One element of a view of any float dtype, widened to double (exact), and its store.
inline double LoadAny(const void* p, DType dtype) {
  return DispatchDType(dtype, [&](auto tag) -> double {
    using T = decltype(tag);
    return static_cast<double>(Load(static_cast<const T*>(p)));
  });
}

inline void StoreAny(void* p, DType dtype, double v) {
  DispatchDType(dtype, [&](auto tag) {
    using T = decltype(tag);
    Store(static_cast<T*>(p), static_cast<Acc<T>>(v));
    return 0;
  });
}

}  // namespace tokamax::moe
