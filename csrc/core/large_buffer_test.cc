// LargeBuffer: zero-filled when asked and writable end to end, from malloc and mapped, and
// movable without a double free.
#include "csrc/core/large_buffer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>

namespace tokamax {
namespace {

TEST(LargeBufferTest, ZeroFilledAndWritableAtEverySize) {
  // 1 float, a few KiB, at the map threshold (malloc), just past it and an odd size (mapped).
  constexpr int64_t kThresholdFloats = LargeBufferBytes::kMapThreshold / sizeof(float);
  for (int64_t count : {int64_t{1}, int64_t{1000}, kThresholdFloats, kThresholdFloats + 1, kThresholdFloats + 777}) {
    LargeBuffer<float> buffer(count, LargeBuffer<float>::kZeroed);
    ASSERT_NE(buffer.data(), nullptr) << count;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % 16, 0u) << count;
    int64_t nonzero = 0;
    for (int64_t i = 0; i < count; ++i) nonzero += buffer[i] != 0.0f;
    EXPECT_EQ(nonzero, 0) << count;
    for (int64_t i = 0; i < count; ++i) buffer[i] = static_cast<float>(i);
    EXPECT_EQ(buffer[count - 1], static_cast<float>(count - 1)) << count;
    LargeBuffer<float> scratch(count, LargeBuffer<float>::kUninitialized);
    ASSERT_NE(scratch.data(), nullptr) << count;
    scratch[0] = scratch[count - 1] = 1.0f;  // writable at both ends
    EXPECT_EQ(scratch[0] + scratch[count - 1], 2.0f) << count;
  }
}

TEST(LargeBufferTest, MoveTransfersOwnership) {
  LargeBuffer<uint16_t> a(int64_t{20} << 20, LargeBuffer<uint16_t>::kZeroed);  // 40 MiB: mapped
  a[5] = 7;
  LargeBuffer<uint16_t> b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b[5], 7);
  LargeBuffer<uint16_t> c(16, LargeBuffer<uint16_t>::kZeroed);
  c = std::move(b);  // frees c's own buffer, takes b's
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(c[5], 7);
  EXPECT_EQ(LargeBuffer<float>().data(), nullptr);
}

}  // namespace
}  // namespace tokamax
