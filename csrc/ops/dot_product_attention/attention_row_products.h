// The decode path's row products (ForwardRowTask), one table per ISA tier
// (attention_row_products_tiered.cc): dot products of a few query rows with K rows, and the
// probability-weighted sums of V rows, read in place. Private to dot_product_attention.
#pragma once

#include <cstdint>

#include "csrc/core/base/dtype.h"
#include "csrc/core/runtime/isa.h"

namespace tokamax {
namespace attention {

// The most query rows one row product takes (its accumulators stay in registers).
constexpr int64_t kMaxRowDotRows = 8;

struct RowProducts {
  // st[j * ld_st + r] = sum_h key[j][h] * q[r][h] for j < keys, r < rows (at most
  // kMaxRowDotRows): key rows of `dtype` at key + j * ld_key, contiguous along h; q fp32 rows
  // of length depth at q + r * ld_q. Reads each key row once.
  // The row products take `next`, null or rows of the same shape and stride as the ones they
  // read (the caller's next run; which rows come next is the caller's to know), and ask for
  // them into L2 as they go, one prefetch beside each vector they load, so the requests go out
  // spread across the multiply-adds rather than in a burst before them. They never read `next`.
  void (*key_dots)(DType dtype, const void* key, int64_t ld_key, int64_t keys, int64_t depth, const float* q,
                   int64_t ld_q, int64_t rows, float* st, int64_t ld_st, const void* next);
  // acc[r][e] += sum_j p[j * ld_p + r] * value[j][e] for r < rows, e < width: value rows of
  // `dtype` at value + j * ld_value, contiguous along e; acc fp32 rows at acc + r * ld_acc.
  void (*accumulate_values)(DType dtype, const float* p, int64_t ld_p, int64_t keys, int64_t rows,
                            const void* value, int64_t ld_value, int64_t width, float* acc, int64_t ld_acc,
                            const void* next);
  // The row products for bf16 K, V and queries on the AVX512-BF16 dot instruction, pairs of
  // elements per multiply-add (the avx512bf16 tier; null on the others). depth and width are
  // multiples of 32, rows at most kMaxRowDotRows.
  // st[j * ld_st + r] = scale * sum_h key[j][h] * q[r][h]: key_dots with bf16 query rows
  // (unscaled, so exact) at q + r * ld_q.
  void (*key_dots_bf16)(const uint16_t* key, int64_t ld_key, int64_t keys, int64_t depth, const uint16_t* q,
                        int64_t ld_q, int64_t rows, float scale, float* st, int64_t ld_st,
                        const uint16_t* next) = nullptr;
  // accumulate_values of bf16 value rows with p rounded to bf16 (as the bf16 engine's P·V).
  void (*accumulate_values_bf16)(const float* p, int64_t ld_p, int64_t keys, int64_t rows, const uint16_t* value,
                                 int64_t ld_value, int64_t width, float* acc, int64_t ld_acc,
                                 const uint16_t* next) = nullptr;
};

const RowProducts& GetRowProducts(Isa isa);

}  // namespace attention
}  // namespace tokamax
