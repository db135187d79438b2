// Integer helpers for tiling: the one definition every kernel and heuristic uses.
#pragma once

#include <cstdint>

namespace tokamax {

// ceil(a / b) for a >= 0, b > 0: the number of b-sized blocks that cover a.
constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The least multiple of b that is at least a (a >= 0, b > 0).
constexpr int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

}  // namespace tokamax
