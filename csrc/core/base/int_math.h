// Integer helpers for tiling: the one definition every kernel and heuristic uses.
#pragma once

#include <cstdint>
#include <type_traits>

namespace tokamax {

// ceil(a / b) for a >= 0, b > 0: the number of b-sized blocks that cover a.
constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The least multiple of b that is at least a (a >= 0, b > 0).
constexpr int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// fn(std::integral_constant<int, n>{}) with n = `rows` clamped to [1, kMax]: a run-time row count
// as the compile-time one of a kernel unrolled per row count (its instances 1..kMax).
template <int kMax, int kRows = 1, typename Fn>
inline decltype(auto) DispatchRows(int64_t rows, Fn&& fn) {
  static_assert(1 <= kRows && kRows <= kMax, "row counts 1..kMax");
  if constexpr (kRows == kMax) {
    return fn(std::integral_constant<int, kRows>{});
  } else {
    if (rows <= kRows) return fn(std::integral_constant<int, kRows>{});
    return DispatchRows<kMax, kRows + 1>(rows, static_cast<Fn&&>(fn));
  }
}

}  // namespace tokamax
