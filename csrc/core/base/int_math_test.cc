#include "csrc/core/base/int_math.h"

#include <gtest/gtest.h>

namespace tokamax {
namespace {

TEST(IntMathTest, CeilDivAndRoundUp) {
  EXPECT_EQ(CeilDiv(0, 4), 0);
  EXPECT_EQ(CeilDiv(9, 4), 3);
  EXPECT_EQ(RoundUp(9, 4), 12);
  EXPECT_EQ(RoundUp(12, 4), 12);
}

TEST(IntMathTest, DispatchRowsGivesTheClampedCountAtCompileTime) {
  auto instance = [](int64_t rows) {
    return DispatchRows<4>(rows, [](auto n) {
      constexpr int kRows = decltype(n)::value;  // usable as a template argument
      static_assert(1 <= kRows && kRows <= 4);
      return kRows;
    });
  };
  EXPECT_EQ(instance(1), 1);
  EXPECT_EQ(instance(2), 2);
  EXPECT_EQ(instance(3), 3);
  EXPECT_EQ(instance(4), 4);
  EXPECT_EQ(instance(9), 4);
  EXPECT_EQ(instance(0), 1);
}

}  // namespace
}  // namespace tokamax
