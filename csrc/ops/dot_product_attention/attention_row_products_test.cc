// The decode path's row products (key_dots, accumulate_values, and the bf16 ones where a tier
// has them) on every tier, against float64
// sums of the same (exactly representable) inputs: every row count the kernels specialise, head
// dims with and without vector tails, key counts that leave partial groups, strided rows.
#include "csrc/ops/dot_product_attention/attention_row_products.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/base/test_util.h"

namespace tokamax {
namespace attention {
namespace {

using testing::Buffer;

// The row products' results against float64 sums, as {largest logit error, largest accumulator
// error}: st[j * ld_st + r] = scale * sum_h key(j, h) q(r, h) for j < keys, r < rows, and NaN
// (the poison) past rows and in the row after the last key; acc[r * ld_acc + e] = 0.5 + sum_j
// weight(j, r) key(j, e) for e < depth, and 0.5 (untouched) past it.
template <typename QAt, typename WeightAt>
std::pair<double, double> RowProductErrors(const Buffer& key, int64_t ld_key, int64_t keys, int64_t depth,
                                           int64_t rows, QAt q_at, double scale, WeightAt weight_at,
                                           const std::vector<float>& st, int64_t ld_st, const std::vector<float>& acc,
                                           int64_t ld_acc) {
  double dot_error = 0.0, acc_error = 0.0;
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t r = 0; r < rows; ++r) {
      double want = 0.0;
      for (int64_t h = 0; h < depth; ++h) want += double{key.Get(j * ld_key + h)} * q_at(r, h);
      dot_error = std::max(dot_error, std::abs(scale * want - st[j * ld_st + r]));
    }
    for (int64_t r = rows; r < ld_st; ++r) EXPECT_TRUE(std::isnan(st[j * ld_st + r]));
  }
  for (int64_t r = 0; r < ld_st; ++r) EXPECT_TRUE(std::isnan(st[keys * ld_st + r]));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < ld_acc; ++e) {
      if (e >= depth) {
        EXPECT_EQ(acc[r * ld_acc + e], 0.5f);  // past the width: untouched
        continue;
      }
      double want = 0.5;
      for (int64_t j = 0; j < keys; ++j) want += weight_at(j, r) * key.Get(j * ld_key + e);
      acc_error = std::max(acc_error, std::abs(want - acc[r * ld_acc + e]));
    }
  }
  return {dot_error, acc_error};
}

class RowDotsTest : public ::testing::TestWithParam<std::tuple<Isa, DType>> {};

TEST_P(RowDotsTest, KeyDotsAndAccumulateValuesMatchFloat64) {
  const auto [isa, dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const RowProducts& kernels = GetRowProducts(isa);
  for (int64_t rows = 1; rows <= kMaxRowDotRows; ++rows) {
    for (int64_t depth : {1, 7, 16, 40, 128, 130}) {
      for (int64_t keys : {1, 5, 16, 19}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " depth " + std::to_string(depth) + " keys " +
                     std::to_string(keys));
        const int64_t ld_key = depth + 3, ld_st = 16, ld_acc = depth + 5;  // strided rows
        Buffer key(dtype, keys * ld_key, /*misalign=*/1);
        testing::FillRandom(key, keys * ld_key, 11 + rows);
        std::vector<float> q(rows * depth), p(keys * ld_st);
        for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37 * i) * 0.5f;
        for (size_t i = 0; i < p.size(); ++i) p[i] = 0.25f + std::cos(0.11 * i) * 0.25f;
        // Poisoned where the kernels must not write: columns past `rows`, rows past `keys`.
        std::vector<float> st((keys + 1) * ld_st, std::nanf(""));
        kernels.key_dots(dtype, key.data(), ld_key, keys, depth, q.data(), depth, rows, st.data(), ld_st, nullptr);
        std::vector<float> acc(rows * ld_acc, 0.5f);
        kernels.accumulate_values(dtype, p.data(), ld_st, keys, rows, key.data(), ld_key, depth, acc.data(), ld_acc,
                                  nullptr);
        const auto [dot_error, acc_error] = RowProductErrors(
            key, ld_key, keys, depth, rows, [&](int64_t r, int64_t h) { return double{q[r * depth + h]}; }, 1.0,
            [&](int64_t j, int64_t r) { return double{p[j * ld_st + r]}; }, st, ld_st, acc, ld_acc);
        EXPECT_LT(dot_error, 1e-5 * depth);
        EXPECT_LT(acc_error, 1e-5 * keys);
      }
    }
  }
}

TEST_P(RowDotsTest, DotsDoNotDependOnHowKeysAreGrouped) {
  // The decode path calls key_dots on runs of keys: a key's logit must be the same bits
  // whether it is computed in a group, alone, or at a different offset.
  const auto [isa, dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const RowProducts& kernels = GetRowProducts(isa);
  const int64_t keys = 21, depth = 72, rows = 4, ld_st = 16;
  Buffer key(dtype, keys * depth);
  testing::FillRandom(key, keys * depth, 3);
  std::vector<float> q(rows * depth);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.23 * i);
  std::vector<float> whole(keys * ld_st, 0.0f), pieces(keys * ld_st, 0.0f);
  kernels.key_dots(dtype, key.data(), depth, keys, depth, q.data(), depth, rows, whole.data(), ld_st, nullptr);
  const auto* bytes = static_cast<const uint8_t*>(key.data());
  for (int64_t j0 = 0; j0 < keys; j0 += 3) {
    const int64_t n = std::min<int64_t>(3, keys - j0);
    kernels.key_dots(dtype, bytes + j0 * depth * DTypeSize(dtype), depth, n, depth, q.data(), depth, rows,
                     pieces.data() + j0 * ld_st, ld_st, nullptr);
  }
  EXPECT_EQ(whole, pieces);
}

// The bf16 row products (key_dots_bf16, accumulate_values_bf16) of the tiers that have them.
class Bf16RowDotsTest : public ::testing::TestWithParam<Isa> {};

TEST_P(RowDotsTest, PrefetchingTheNextRowsChangesNothing) {
  // `next` rows are only asked for, never read: the same bits with and without them, and with
  // rows that hold other values.
  const auto [isa, dtype] = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const RowProducts& kernels = GetRowProducts(isa);
  const int64_t keys = 19, depth = 136, rows = 4, ld_key = depth + 8, ld_st = 16;
  Buffer key(dtype, keys * ld_key), next(dtype, keys * ld_key);
  testing::FillRandom(key, keys * ld_key, 7);
  testing::FillRandom(next, keys * ld_key, 8);
  std::vector<float> q(rows * depth), p(keys * ld_st);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.19 * i);
  for (size_t i = 0; i < p.size(); ++i) p[i] = 0.5f + std::cos(0.07 * i) * 0.25f;
  std::vector<float> st_plain(keys * ld_st, 0.0f), st_next(keys * ld_st, 0.0f);
  std::vector<float> acc_plain(rows * depth, 0.25f), acc_next(rows * depth, 0.25f);
  kernels.key_dots(dtype, key.data(), ld_key, keys, depth, q.data(), depth, rows, st_plain.data(), ld_st, nullptr);
  kernels.key_dots(dtype, key.data(), ld_key, keys, depth, q.data(), depth, rows, st_next.data(), ld_st, next.data());
  kernels.accumulate_values(dtype, p.data(), ld_st, keys, rows, key.data(), ld_key, depth, acc_plain.data(), depth,
                            nullptr);
  kernels.accumulate_values(dtype, p.data(), ld_st, keys, rows, key.data(), ld_key, depth, acc_next.data(), depth,
                            next.data());
  EXPECT_EQ(st_plain, st_next);
  EXPECT_EQ(acc_plain, acc_next);
}

TEST_P(Bf16RowDotsTest, MatchFloat64WithWeightsRoundedToBf16) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const RowProducts& kernels = GetRowProducts(isa);
  ASSERT_NE(kernels.key_dots_bf16, nullptr);
  ASSERT_NE(kernels.accumulate_values_bf16, nullptr);
  for (int64_t rows = 1; rows <= kMaxRowDotRows; ++rows) {
    // Widths of 1 to 5 32-column blocks (every block count the kernel specialises, and its tail);
    // key counts with an odd last key, full 16-key runs and more than one call's 64 keys.
    for (int64_t depth : {32, 64, 96, 128, 160}) {
      for (int64_t keys : {1, 5, 16, 19, 70}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " depth " + std::to_string(depth) + " keys " +
                     std::to_string(keys));
        const int64_t ld_key = depth + 16, ld_q = depth + 32, ld_st = 16, ld_acc = depth + 5;  // strided rows
        Buffer key(DType::kBFloat16, keys * ld_key, /*misalign=*/1);
        testing::FillRandom(key, keys * ld_key, 21 + rows);
        Buffer q(DType::kBFloat16, rows * ld_q);
        testing::FillRandom(q, rows * ld_q, 5 + keys);
        std::vector<float> p(keys * ld_st);
        for (size_t i = 0; i < p.size(); ++i) p[i] = 0.25f + std::cos(0.11 * i) * 0.25f;
        std::vector<float> st((keys + 1) * ld_st, std::nanf(""));  // poisoned past rows and keys
        const float scale = 0.37f;
        const auto* key_bits = static_cast<const uint16_t*>(key.data());
        kernels.key_dots_bf16(key_bits, ld_key, keys, depth, static_cast<const uint16_t*>(q.data()), ld_q, rows, scale,
                              st.data(), ld_st, nullptr);
        std::vector<float> acc(rows * ld_acc, 0.5f);
        kernels.accumulate_values_bf16(p.data(), ld_st, keys, rows, key_bits, ld_key, depth, acc.data(), ld_acc,
                                       nullptr);
        const auto [dot_error, acc_error] = RowProductErrors(
            key, ld_key, keys, depth, rows, [&](int64_t r, int64_t h) { return double{q.Get(r * ld_q + h)}; }, scale,
            [&](int64_t j, int64_t r) { return double{BFloat16ToFloat(FloatToBFloat16(p[j * ld_st + r]))}; }, st,
            ld_st, acc, ld_acc);
        EXPECT_LT(dot_error, 1e-5 * depth);
        EXPECT_LT(acc_error, 1e-5 * keys);
      }
    }
  }
}

TEST_P(Bf16RowDotsTest, DotsDoNotDependOnHowKeysAreGrouped) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const RowProducts& kernels = GetRowProducts(isa);
  ASSERT_NE(kernels.key_dots_bf16, nullptr);
  const int64_t keys = 21, depth = 96, rows = 4, ld_st = 16;
  Buffer key(DType::kBFloat16, keys * depth), q(DType::kBFloat16, rows * depth);
  testing::FillRandom(key, keys * depth, 3);
  testing::FillRandom(q, rows * depth, 4);
  const auto* key_bits = static_cast<const uint16_t*>(key.data());
  const auto* q_bits = static_cast<const uint16_t*>(q.data());
  std::vector<float> whole(keys * ld_st, 0.0f), pieces(keys * ld_st, 0.0f);
  kernels.key_dots_bf16(key_bits, depth, keys, depth, q_bits, depth, rows, 0.5f, whole.data(), ld_st, nullptr);
  for (int64_t j0 = 0; j0 < keys; j0 += 3) {
    const int64_t n = std::min<int64_t>(3, keys - j0);
    kernels.key_dots_bf16(key_bits + j0 * depth, depth, n, depth, q_bits, depth, rows, 0.5f,
                          pieces.data() + j0 * ld_st, ld_st, nullptr);
  }
  EXPECT_EQ(whole, pieces);
}

TEST_P(Bf16RowDotsTest, PrefetchingTheNextRowsChangesNothing) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa, GetCpuInfo())) GTEST_SKIP() << IsaName(isa) << " not supported here";
  const RowProducts& kernels = GetRowProducts(isa);
  ASSERT_NE(kernels.key_dots_bf16, nullptr);
  const int64_t keys = 19, depth = 128, rows = 4, ld_key = depth + 32, ld_st = 16;
  Buffer key(DType::kBFloat16, keys * ld_key), next(DType::kBFloat16, keys * ld_key), q(DType::kBFloat16, rows * depth);
  testing::FillRandom(key, keys * ld_key, 9);
  testing::FillRandom(next, keys * ld_key, 10);
  testing::FillRandom(q, rows * depth, 11);
  const auto* key_bits = static_cast<const uint16_t*>(key.data());
  const auto* next_bits = static_cast<const uint16_t*>(next.data());
  const auto* q_bits = static_cast<const uint16_t*>(q.data());
  std::vector<float> p(keys * ld_st);
  for (size_t i = 0; i < p.size(); ++i) p[i] = 0.5f + std::cos(0.07 * i) * 0.25f;
  std::vector<float> st_plain(keys * ld_st, 0.0f), st_next(keys * ld_st, 0.0f);
  std::vector<float> acc_plain(rows * depth, 0.25f), acc_next(rows * depth, 0.25f);
  kernels.key_dots_bf16(key_bits, ld_key, keys, depth, q_bits, depth, rows, 0.5f, st_plain.data(), ld_st, nullptr);
  kernels.key_dots_bf16(key_bits, ld_key, keys, depth, q_bits, depth, rows, 0.5f, st_next.data(), ld_st, next_bits);
  kernels.accumulate_values_bf16(p.data(), ld_st, keys, rows, key_bits, ld_key, depth, acc_plain.data(), depth,
                                 nullptr);
  kernels.accumulate_values_bf16(p.data(), ld_st, keys, rows, key_bits, ld_key, depth, acc_next.data(), depth,
                                 next_bits);
  EXPECT_EQ(st_plain, st_next);
  EXPECT_EQ(acc_plain, acc_next);
}

INSTANTIATE_TEST_SUITE_P(TiersWithThem, Bf16RowDotsTest, ::testing::Values(Isa::kAvx512Bf16),
                         [](const auto& info) { return std::string(IsaName(info.param)); });

TEST(Bf16RowDotsTierTest, OnlyTheAvx512Bf16TierHasThem) {
  // The other tiers widen bf16 in key_dots / accumulate_values (amx too: measured slower there).
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx}) {
    EXPECT_EQ(GetRowProducts(isa).key_dots_bf16, nullptr) << IsaName(isa);
    EXPECT_EQ(GetRowProducts(isa).accumulate_values_bf16, nullptr) << IsaName(isa);
  }
  // Where the tier is not built (IsaBuilt), its table is the scalar one.
  const bool built = IsaBuilt(Isa::kAvx512Bf16);
  EXPECT_EQ(GetRowProducts(Isa::kAvx512Bf16).key_dots_bf16 != nullptr, built);
  EXPECT_EQ(GetRowProducts(Isa::kAvx512Bf16).accumulate_values_bf16 != nullptr, built);
}

INSTANTIATE_TEST_SUITE_P(
    AllTiers, RowDotsTest,
    ::testing::Combine(::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16)),
    [](const auto& info) {
      return std::string(IsaName(std::get<0>(info.param))) + "_" + DTypeName(std::get<1>(info.param));
    });

}  // namespace
}  // namespace attention
}  // namespace tokamax
