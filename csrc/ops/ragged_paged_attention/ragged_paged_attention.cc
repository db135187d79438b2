// The ragged_paged_attention CPU kernel. A task is (sequence, query tile, kv heads, key split):
// its query rows (tokens x query heads, kv head by kv head) walk the visible keys in tiles of
// block_kv positions, page by page, in runs of kRunKeys keys with every kv head of a run before
// the next run, so a page's rows are read in memory order and each K or V row once per task for
// every query head of its group (GQA reuse); tasks of few rows per kv head (decode) first copy
// each tile's rows into a contiguous scratch (stage_rows). The row products are attention's (key_dots /
// accumulate_values, one table per ISA tier) and the online softmax its softmax pieces, fp32.
// A sequence of one query tile (decode) is split every split_kv keys into tasks whose partial
// (max, sum, acc) merge in split order: the split depends on the config, never on the thread
// count, so the bits do not either.
#include "csrc/ops/ragged_paged_attention/ragged_paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "csrc/core/base/int_math.h"
#include "csrc/core/runtime/isa.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/core/runtime/scratch_arena.h"
#include "csrc/core/softmax/softmax_kernels.h"
#include "csrc/ops/dot_product_attention/attention_row_products.h"
#include "csrc/ops/dot_product_attention/dot_product_attention.h"

namespace tokamax {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr const char* kOp = "ragged_paged_attention";
// Keys per row-product call: every kv head's rows of a run are read before the next run's, so a
// page is walked in memory order (attention's row path found head-by-head walks half as fast).
constexpr int64_t kRunKeys = 16;
constexpr int64_t kRows = attention::kMaxRowDotRows;

enum ScratchSlots { kQRows, kQBf16Rows, kSt, kAcc, kMax, kSum, kSub, kAlpha, kTileMax, kLo, kHi, kStaged };

std::string Str(int64_t v) { return std::to_string(v); }

struct Seq {
  int64_t q0 = 0, q_len = 0, kv_len = 0;
};

struct Task {
  int64_t seq, t0, t1, g0, g1, k0, k1;  // tokens [t0, t1) of the sequence (relative), kv heads, keys
  int64_t split;                        // the split's index, -1 when the task sees all its keys
};

// Where the merge finds the splits of a split sequence: splits x (q_len * Hq) records of D + 2
// floats (max, sum, acc) from `record`.
struct SplitSeq {
  int64_t seq, splits, record;
};

Seq SeqOf(const RaggedPagedAttentionParams& p, int64_t s) {
  Seq q;
  q.q0 = p.cu_q_lens[s];
  q.q_len = p.cu_q_lens[s + 1] - q.q0;
  q.kv_len = p.kv_lens[s];
  return q;
}

// The keys token i (relative) of `q` sees: [lo, hi). With a mask value every key of the sequence
// takes part (masked ones at mask_value).
void VisibleKeys(const RaggedPagedAttentionParams& p, const Seq& q, int64_t i, int64_t* lo, int64_t* hi) {
  const int64_t pos = q.kv_len - q.q_len + i;
  *lo = 0;
  *hi = q.kv_len;
  if (p.has_mask_value) return;
  if (p.causal) *hi = pos + 1;
  if (p.sliding_window > 0) *lo = std::max<int64_t>(0, pos - p.sliding_window + 1);
}

void UnmaskedKeys(const RaggedPagedAttentionParams& p, const Seq& q, int64_t i, int64_t* lo, int64_t* hi) {
  const int64_t pos = q.kv_len - q.q_len + i;
  *lo = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
  *hi = p.causal ? pos + 1 : q.kv_len;
}

struct Kernels {
  const attention::RowProducts* rows;
  const SoftmaxKernels* softmax;
  bool bf16_rows;
};

template <typename T>
T* Scratch(ScratchLease& s, int slot, int64_t count) {
  return s.Get<T>(slot, count);
}

// One task: rows r = (g - g0) * (tokens * group) + i * group + j (query head g * group + j).
void RunTask(const RaggedPagedAttentionParams& p, const RaggedPagedAttentionConfig& config, const Kernels& k,
             const Task& task, const SplitSeq* split_seq, float* partials) {
  const Seq q = SeqOf(p, task.seq);
  const int64_t q_heads = p.queries.sizes[1], kv_heads = p.keys.sizes[1], d = p.queries.sizes[2];
  const int64_t group = q_heads / kv_heads, page_size = p.kv_cache.sizes[1];
  const int64_t pages_per_seq = p.page_indices.count / p.kv_lens.count;
  const int64_t tokens = task.t1 - task.t0, per_head = tokens * group, heads = task.g1 - task.g0;
  const int64_t rows = heads * per_head, cols = RoundUp(rows, 16), block = config.block_kv;
  ScratchLease lease;
  float* qf = nullptr;
  uint16_t* qb = nullptr;
  if (k.bf16_rows) {
    qb = Scratch<uint16_t>(lease, kQBf16Rows, rows * d);
  } else {
    qf = Scratch<float>(lease, kQRows, rows * d);
  }
  for (int64_t g = task.g0; g < task.g1; ++g) {
    for (int64_t i = 0; i < tokens; ++i) {
      for (int64_t j = 0; j < group; ++j) {
        const int64_t r = (g - task.g0) * per_head + i * group + j;
        const int64_t t = q.q0 + task.t0 + i, n = g * group + j;
        if (qb != nullptr) {
          const uint16_t* src = static_cast<const uint16_t*>(p.queries.At(t, n, 0));
          for (int64_t e = 0; e < d; ++e) qb[r * d + e] = src[e * p.queries.strides[2]];
        } else if (p.queries.strides[2] == 1) {
          k.softmax->widen_row(p.queries.dtype, p.queries.At(t, n, 0), d, p.sm_scale, qf + r * d);
        } else {
          DispatchDType(p.queries.dtype, [&](auto tag) {
            using T = decltype(tag);
            const T* src = static_cast<const T*>(p.queries.At(t, n, 0));
            for (int64_t e = 0; e < d; ++e) qf[r * d + e] = p.sm_scale * LoadAsFloat(src + e * p.queries.strides[2]);
            return 0;
          });
        }
      }
    }
  }
  float* st = Scratch<float>(lease, kSt, block * cols);
  float* acc = Scratch<float>(lease, kAcc, rows * d);
  float* max = Scratch<float>(lease, kMax, cols);
  float* sum = Scratch<float>(lease, kSum, cols);
  float* sub = Scratch<float>(lease, kSub, cols);
  float* alpha = Scratch<float>(lease, kAlpha, cols);
  float* tile_max = Scratch<float>(lease, kTileMax, cols);
  float* lo_col = Scratch<float>(lease, kLo, cols);
  float* hi_col = Scratch<float>(lease, kHi, cols);
  // The row products write the real columns only; the softmax reads all: padding starts finite.
  std::fill(st, st + block * cols, 0.0f);
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(max, max + cols, kNegInf);
  std::fill(sum, sum + cols, 0.0f);
  // The task's key range: the union of its tokens' (positions increase with i), within its split.
  int64_t k_lo = 0, k_hi = 0, last_lo = 0, first_hi = 0;
  VisibleKeys(p, q, task.t0, &k_lo, &first_hi);
  VisibleKeys(p, q, task.t1 - 1, &last_lo, &k_hi);
  k_lo = std::max(k_lo, task.k0);
  k_hi = std::min(k_hi, task.k1);
  // Every column's unmasked keys (absolute), for the tiles that need a mask.
  int64_t all_lo = 0, all_hi = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> col_lo(static_cast<size_t>(rows)), col_hi(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    int64_t lo, hi;
    UnmaskedKeys(p, q, task.t0 + (r % per_head) / group, &lo, &hi);
    col_lo[r] = lo;
    col_hi[r] = hi;
    all_lo = std::max(all_lo, lo);
    all_hi = std::min(all_hi, hi);
  }
  const DType kv_dtype = p.kv_cache.dtype;
  // The row of key position `pos` of merged head `merged` (2h: K of kv head h, 2h + 1: its V).
  auto row_at = [&](int64_t pos, int64_t merged) -> const void* {
    return p.kv_cache.At(p.page_indices[task.seq * pages_per_seq + pos / page_size], pos % page_size, merged, 0);
  };
  // Staging (tasks of few rows per kv head, where the passes wait on memory): each tile's rows of
  // the task's merged heads [2 g0, 2 g1) are first copied in memory order, token row by token row,
  // into `staged` [block, 2 * heads, D]; the passes then read the copy. Walked in place, a head's
  // rows are a 4-8 KiB stride that the hardware prefetchers follow past the page's end into
  // whatever page lies next in memory (another sequence's: measured slower than any in-order
  // layout, docs/benchmarks.md). The copy holds the same values, so the bits do not change.
  const int64_t element = DTypeSize(kv_dtype), span = 2 * heads * d;
  const bool staged_rows = config.stage_rows > 0 && per_head <= config.stage_rows && span > 0;
  char* staged = staged_rows ? Scratch<char>(lease, kStaged, block * span * element) : nullptr;
  const int64_t ld = staged_rows ? span : p.kv_cache.strides[1];
  auto stage_tile = [&](int64_t s0, int64_t s1) {
    for (int64_t pos = s0; pos < s1; ++pos) {
      char* dst = staged + (pos - s0) * span * element;
      if (p.kv_cache.strides[2] == d) {  // the merged heads of a token row adjacent: one copy
        std::memcpy(dst, row_at(pos, 2 * task.g0), static_cast<size_t>(span * element));
        continue;
      }
      for (int64_t m = 0; m < 2 * heads; ++m) {
        std::memcpy(dst + m * d * element, row_at(pos, 2 * task.g0 + m), static_cast<size_t>(d * element));
      }
    }
  };
  // for_runs(s0, s1, which, run): run(g, rows, keys, st row, pos) for every run of kRunKeys keys
  // at position pos of the tile [s0, s1) (runs stop at page ends), every kv head of a run before
  // the next run; the rows are the staged copy's when the task stages.
  auto for_runs = [&](int64_t s0, int64_t s1, int64_t which, auto&& run) {
    for (int64_t pos = s0; pos < s1;) {
      const int64_t page = pos / page_size, offset = pos % page_size;
      const int64_t n = std::min(s1 - pos, page_size - offset);
      const int64_t physical = p.page_indices[task.seq * pages_per_seq + page];
      for (int64_t j0 = 0; j0 < n; j0 += kRunKeys) {
        const int64_t keys = std::min(kRunKeys, n - j0);
        for (int64_t g = task.g0; g < task.g1; ++g) {
          const void* rows_at =
              staged_rows ? static_cast<const void*>(staged + ((pos + j0 - s0) * span + (2 * (g - task.g0) + which) * d) * element)
                          : p.kv_cache.At(physical, offset + j0, 2 * g + which, 0);
          run(g, rows_at, keys, pos - s0 + j0, pos + j0);
        }
      }
      pos += n;
    }
  };
  // Prefetching: a head's rows are a cache row apart (2 * Hkv * D elements) and pages are
  // scattered, so the hardware prefetchers find nothing to follow. The row products ask for
  // `next` as they go, one request beside each vector they load (a burst of requests stalls on
  // the fill buffers): each run the head's next run, the K pass's last run the tile's first V
  // run, the V pass's last run the next tile's first K run (dot_product_attention's row path
  // order). run_rows(from, end, n, merged): the first of n rows from position `from` when they
  // lie before `end` in one page (one stride apart), else null (no request; none when staging:
  // the passes read the copy, and the copy reads memory in order).
  auto run_rows = [&](int64_t from, int64_t end, int64_t n, int64_t merged) -> const void* {
    if (staged_rows || from + n > end || from % page_size + n > page_size) return nullptr;
    return row_at(from, merged);
  };
  for (int64_t t0 = k_lo / block * block; t0 < k_hi; t0 += block) {
    const int64_t s0 = std::max(t0, k_lo), s1 = std::min(t0 + block, k_hi), keys = s1 - s0;
    if (staged_rows) stage_tile(s0, s1);
    for_runs(s0, s1, 0, [&](int64_t g, const void* key, int64_t n, int64_t j, int64_t pos) {
      const void* next = pos + n < s1 ? run_rows(pos + n, s1, n, 2 * g) : run_rows(s0, s1, n, 2 * g + 1);
      const int64_t base = (g - task.g0) * per_head;
      for (int64_t c0 = 0; c0 < per_head; c0 += kRows) {
        const int64_t count = std::min(kRows, per_head - c0);
        if (k.bf16_rows) {
          k.rows->key_dots_bf16(static_cast<const uint16_t*>(key), ld, n, d, qb + (base + c0) * d, d, count,
                                p.sm_scale, st + j * cols + base + c0, cols, static_cast<const uint16_t*>(next));
        } else {
          k.rows->key_dots(kv_dtype, key, ld, n, d, qf + (base + c0) * d, d, count, st + j * cols + base + c0, cols,
                           next);
        }
      }
    });
    if (p.soft_cap > 0) k.softmax->soft_cap(st, keys, cols, rows, p.soft_cap, nullptr, 0);
    // A mask only where some row does not see the whole tile.
    if (s0 < all_lo || s1 > all_hi) {
      if (p.has_mask_value) {
        for (int64_t j = 0; j < keys; ++j) {
          for (int64_t c = 0; c < rows; ++c) {
            if (s0 + j < col_lo[c] || s0 + j >= col_hi[c]) st[j * cols + c] = p.mask_value;
          }
        }
      } else {
        for (int64_t c = 0; c < cols; ++c) {
          lo_col[c] = c < rows ? static_cast<float>(std::clamp<int64_t>(col_lo[c] - s0, 0, keys)) : 0.0f;
          hi_col[c] = c < rows ? static_cast<float>(std::clamp<int64_t>(col_hi[c] - s0, 0, keys))
                               : static_cast<float>(keys);
        }
        k.softmax->mask_columns(st, keys, cols, cols, lo_col, hi_col);
      }
    }
    UpdateRunningMax(*k.softmax, st, keys, cols, cols, max, sum, alpha, sub, tile_max);
    k.softmax->exp_columns(st, keys, cols, cols, sub, sum);
    k.softmax->scale_rows(acc, d, rows, d, alpha);
    for_runs(s0, s1, 1, [&](int64_t g, const void* value, int64_t n, int64_t j, int64_t pos) {
      const void* next = pos + n < s1 ? run_rows(pos + n, s1, n, 2 * g + 1) : run_rows(s1, k_hi, n, 2 * g);
      const int64_t base = (g - task.g0) * per_head;
      for (int64_t c0 = 0; c0 < per_head; c0 += kRows) {
        const int64_t count = std::min(kRows, per_head - c0);
        if (k.bf16_rows) {
          k.rows->accumulate_values_bf16(st + j * cols + base + c0, cols, n, count,
                                         static_cast<const uint16_t*>(value), ld, d, acc + (base + c0) * d, d,
                                         static_cast<const uint16_t*>(next));
        } else {
          k.rows->accumulate_values(kv_dtype, st + j * cols + base + c0, cols, n, count, value, ld, d,
                                    acc + (base + c0) * d, d, next);
        }
      }
    });
  }
  // Results: the row's output and lse, or its split's record.
  for (int64_t g = task.g0; g < task.g1; ++g) {
    for (int64_t i = 0; i < tokens; ++i) {
      for (int64_t j = 0; j < group; ++j) {
        const int64_t r = (g - task.g0) * per_head + i * group + j;
        const int64_t t = q.q0 + task.t0 + i, n = g * group + j;
        const float* a = acc + r * d;
        if (task.split >= 0) {
          float* record = partials + (split_seq->record + (task.split * q.q_len + task.t0 + i) * q_heads + n) * (d + 2);
          record[0] = max[r];
          record[1] = sum[r];
          std::memcpy(record + 2, a, static_cast<size_t>(d) * sizeof(float));
          continue;
        }
        // sum 0: no key seen; NaN (a NaN or overflowed logit) propagates, as in the reference.
        const float inv = sum[r] != 0 ? 1.0f / sum[r] : 0.0f;
        DispatchDType(p.out.dtype, [&](auto tag) {
          using T = decltype(tag);
          T* o = static_cast<T*>(p.out.At(t, n, 0));
          for (int64_t e = 0; e < d; ++e) StoreFromFloat(o + e * p.out.strides[2], a[e] * inv);
          return 0;
        });
        if (p.lse.data != nullptr) {
          *static_cast<float*>(p.lse.At(t, n)) = sum[r] != 0 ? max[r] + std::log(sum[r]) : kNegInf;
        }
      }
    }
  }
}

// The splits of one (token, head) row merged in split order.
void MergeRow(const RaggedPagedAttentionParams& p, const float* records, int64_t splits, int64_t stride, int64_t t,
              int64_t n, float* acc) {
  const int64_t d = p.queries.sizes[2];
  float m = kNegInf;
  for (int64_t c = 0; c < splits; ++c) m = std::max(m, records[c * stride]);
  float total = 0.0f;
  std::fill(acc, acc + d, 0.0f);
  if (m != kNegInf) {
    for (int64_t c = 0; c < splits; ++c) {
      const float* record = records + c * stride;
      if (record[0] == kNegInf) continue;
      const float w = std::exp(record[0] - m);
      total += record[1] * w;
      for (int64_t e = 0; e < d; ++e) acc[e] += w * record[2 + e];
    }
  }
  // A split that met a NaN logit holds a NaN sum whatever its max: the row is NaN.
  for (int64_t c = 0; c < splits; ++c) {
    if (std::isnan(records[c * stride + 1])) total = std::numeric_limits<float>::quiet_NaN();
  }
  const float inv = total != 0 ? 1.0f / total : 0.0f;
  DispatchDType(p.out.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(p.out.At(t, n, 0));
    for (int64_t e = 0; e < d; ++e) StoreFromFloat(o + e * p.out.strides[2], acc[e] * inv);
    return 0;
  });
  if (p.lse.data != nullptr) *static_cast<float*>(p.lse.At(t, n)) = total != 0 ? m + std::log(total) : kNegInf;
}

void ZeroToken(const RaggedPagedAttentionParams& p, int64_t t) {
  const int64_t q_heads = p.out.sizes[1], d = p.out.sizes[2];
  for (int64_t n = 0; n < q_heads; ++n) {
    DispatchDType(p.out.dtype, [&](auto tag) {
      using T = decltype(tag);
      T* o = static_cast<T*>(p.out.At(t, n, 0));
      for (int64_t e = 0; e < d; ++e) StoreFromFloat(o + e * p.out.strides[2], 0.0f);
      return 0;
    });
    if (p.lse.data != nullptr) *static_cast<float*>(p.lse.At(t, n)) = kNegInf;
  }
}

// Whether sequence `q` runs on dot_product_attention's GEMM kernel: long enough, and a call that
// kernel expresses (one dtype throughout, no mask value).
bool UsesGemm(const RaggedPagedAttentionParams& p, const RaggedPagedAttentionConfig& config, const Seq& q) {
  return config.gemm_min_tokens > 0 && q.q_len >= config.gemm_min_tokens && !p.has_mask_value &&
         p.queries.dtype == p.kv_cache.dtype && p.out.dtype == p.queries.dtype && p.queries.sizes[2] > 0;
}

// A prefill sequence: its pages gathered into contiguous K and V ([kv_len, Hkv, D], one copy,
// small against the q_len x kv_len products), then dot_product_attention's forward with the
// causal mask bottom-right aligned (window_right = kv_len - q_len) and the sliding window as its
// left window, out and lse written in place through strided views.
Status RunGemmSequence(const RaggedPagedAttentionParams& p, int64_t s, const Seq& q) {
  const int64_t q_heads = p.queries.sizes[1], kv_heads = p.keys.sizes[1], d = p.queries.sizes[2];
  const int64_t page_size = p.kv_cache.sizes[1], pages_per_seq = p.page_indices.count / p.kv_lens.count;
  const int64_t element = DTypeSize(p.kv_cache.dtype), row = kv_heads * d;
  LargeBuffer<char> k_rows(q.kv_len * row * element, LargeBuffer<char>::kUninitialized);
  LargeBuffer<char> v_rows(q.kv_len * row * element, LargeBuffer<char>::kUninitialized);
  ParallelFor(0, q.kv_len, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t page = p.page_indices[s * pages_per_seq + j / page_size];
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(k_rows.data() + (j * row + h * d) * element, p.kv_cache.At(page, j % page_size, 2 * h, 0),
                    static_cast<size_t>(d * element));
        std::memcpy(v_rows.data() + (j * row + h * d) * element, p.kv_cache.At(page, j % page_size, 2 * h + 1, 0),
                    static_cast<size_t>(d * element));
      }
    }
  });
  DotProductAttentionParams a;
  const int64_t* qs = p.queries.strides;
  a.q = {p.queries.At(q.q0, 0, 0), p.queries.dtype, {1, q.q_len, q_heads, d}, {0, qs[0], qs[1], qs[2]}};
  a.k = {k_rows.data(), p.kv_cache.dtype, {1, q.kv_len, kv_heads, d}, {0, row, d, 1}};
  a.v = {v_rows.data(), p.kv_cache.dtype, {1, q.kv_len, kv_heads, d}, {0, row, d, 1}};
  const int64_t* os = p.out.strides;
  a.out = {p.out.At(q.q0, 0, 0), p.out.dtype, {1, q.q_len, q_heads, d}, {0, os[0], os[1], os[2]}};
  a.scale = p.sm_scale;
  a.logits_soft_cap = p.soft_cap;
  const int64_t offset = q.kv_len - q.q_len;  // query i sits at position offset + i
  if (p.causal) a.masks.window_right = offset;
  if (p.sliding_window > 0) a.masks.window_left = p.sliding_window - 1 - offset;
  if (p.lse.data != nullptr) {
    a.lse = p.lse.At(q.q0, 0);
    a.lse_strides[0] = 0;
    a.lse_strides[1] = p.lse.strides[1];
    a.lse_strides[2] = p.lse.strides[0];
  }
  DotProductAttentionShape shape;
  shape.batch = 1;
  shape.q_len = q.q_len;
  shape.kv_len = q.kv_len;
  shape.q_heads = q_heads;
  shape.kv_heads = kv_heads;
  shape.head_dim = shape.value_dim = d;
  shape.block_sparse = p.causal || p.sliding_window > 0;
  const DotProductAttentionConfig config =
      DotProductAttentionHeuristicConfig(shape, p.queries.dtype, GetCpuInfo(), DotProductAttentionProduct::kForward);
  return DotProductAttention(a, config);
}

}  // namespace

Status CheckRaggedPagedAttentionIndices(const RaggedPagedAttentionParams& p) {
  const int64_t tokens = p.queries.sizes[0], num_seqs = p.kv_lens.count;
  const int64_t total_pages = p.kv_cache.sizes[0], page_size = p.kv_cache.sizes[1];
  const int64_t pages_per_seq = num_seqs > 0 ? p.page_indices.count / num_seqs : 0;
  const int64_t d0 = p.distribution[0], d1 = p.distribution[1], d2 = p.distribution[2];
  if (page_size < 1) {
    return Status::Error(std::string(kOp) + ": kv_cache's page_size (shape[1]) must be at least 1, got " +
                         Str(page_size));
  }
  if (!(0 <= d0 && d0 <= d1 && d1 <= d2 && d2 <= num_seqs)) {
    return Status::Error(std::string(kOp) +
                         ": distribution must be the cumulative sequence counts [decode, decode + prefill, all active]"
                         " with 0 <= d[0] <= d[1] <= d[2] <= S = " + Str(num_seqs) + ", got [" + Str(d0) + ", " +
                         Str(d1) + ", " + Str(d2) + "]");
  }
  if (p.cu_q_lens[0] != 0) {
    return Status::Error(std::string(kOp) + ": cu_q_lens[0] must be 0, got " + Str(p.cu_q_lens[0]));
  }
  for (int64_t s = 0; s < d2; ++s) {
    const int64_t a = p.cu_q_lens[s], b = p.cu_q_lens[s + 1];
    if (b < a) {
      return Status::Error(std::string(kOp) + ": cu_q_lens must be non-decreasing over the " + Str(d2) +
                           " active sequences, got cu_q_lens[" + Str(s) + "] = " + Str(a) + " > cu_q_lens[" +
                           Str(s + 1) + "] = " + Str(b));
    }
  }
  if (p.cu_q_lens[d2] > tokens) {
    return Status::Error(std::string(kOp) + ": cu_q_lens[distribution[2]] = cu_q_lens[" + Str(d2) +
                         "] must be at most the number of tokens T = " + Str(tokens) + ", got " +
                         Str(p.cu_q_lens[d2]));
  }
  for (int64_t s = 0; s < d2; ++s) {
    const Seq q = SeqOf(p, s);
    if (s < d0 && q.q_len != 1) {
      return Status::Error(std::string(kOp) + ": decode sequence " + Str(s) + " (s < distribution[0] = " + Str(d0) +
                           ") must have 1 query token, got " + Str(q.q_len));
    }
    if (q.kv_len < q.q_len || q.kv_len > pages_per_seq * page_size) {
      return Status::Error(std::string(kOp) + ": kv_lens[" + Str(s) + "] must be in [q_len, pages_per_seq * page_size] = [" +
                           Str(q.q_len) + ", " + Str(pages_per_seq * page_size) +
                           "] (its cache ends with its q_len new tokens), got " + Str(q.kv_len));
    }
    for (int64_t i = 0; i < CeilDiv(q.kv_len, page_size); ++i) {
      const int64_t index = s * pages_per_seq + i, page = p.page_indices[index];
      if (page < 0 || page >= total_pages) {
        return Status::Error(std::string(kOp) + ": page_indices[" + Str(index) + "] (page " + Str(i) +
                             " of sequence " + Str(s) + ") must be in [0, total_pages = " + Str(total_pages) +
                             "), got " + Str(page));
      }
    }
  }
  return Status::Ok();
}

void RaggedPagedAttentionSlots(const RaggedPagedAttentionParams& p, int64_t* slots) {
  const int64_t tokens = p.queries.sizes[0], page_size = p.kv_cache.sizes[1];
  const int64_t num_seqs = p.kv_lens.count, active = p.distribution[2];
  const int64_t pages_per_seq = num_seqs > 0 ? p.page_indices.count / num_seqs : 0;
  std::fill(slots, slots + tokens, int64_t{-1});
  for (int64_t s = 0; s < active; ++s) {
    const Seq q = SeqOf(p, s);
    for (int64_t i = 0; i < q.q_len; ++i) {
      const int64_t pos = q.kv_len - q.q_len + i;
      slots[q.q0 + i] = p.page_indices[s * pages_per_seq + pos / page_size] * page_size + pos % page_size;
    }
  }
}

Status RaggedPagedAttention(const RaggedPagedAttentionParams& p, const RaggedPagedAttentionConfig& config) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  status = CheckRaggedPagedAttentionIndices(p);
  if (!status.ok()) return status;
  const int64_t tokens = p.queries.sizes[0], q_heads = p.queries.sizes[1], kv_heads = p.keys.sizes[1];
  const int64_t d = p.queries.sizes[2];
  if (!p.skip_kv_update && tokens > 0) {
    // kv_cache_update's core writes the new tokens: its slot check (no slot twice) first.
    LargeBuffer<int64_t> slots(tokens, LargeBuffer<int64_t>::kUninitialized);
    RaggedPagedAttentionSlots(p, slots.data());
    KvCacheUpdateParams update;
    update.cache = p.kv_cache;
    update.keys = p.keys;
    update.values = p.values;
    update.slots.data = slots.data();
    update.slots.is_int64 = true;
    update.slots.count = tokens;
    update.slots.stride = 1;
    status = KvCacheUpdate(update);
    if (!status.ok()) {
      return Status::Error(std::string(kOp) + ": the new tokens' cache slots (from page_indices, kv_lens and "
                           "cu_q_lens): " + status.message());
    }
  }
  Isa isa;
  status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  Kernels k;
  k.rows = &attention::GetRowProducts(isa);
  k.softmax = &GetSoftmaxKernels(isa);
  k.bf16_rows = k.rows->key_dots_bf16 != nullptr && p.queries.dtype == DType::kBFloat16 &&
                p.kv_cache.dtype == DType::kBFloat16 && d % 32 == 0 && d > 0;

  // Tasks and the splits' records.
  const int64_t active = p.distribution[2], group = kv_heads > 0 ? q_heads / kv_heads : 1;
  std::vector<Task> tasks;
  std::vector<SplitSeq> split_seqs;
  std::vector<int64_t> split_of(static_cast<size_t>(active), -1);
  int64_t records = 0;
  for (int64_t s = 0; s < active; ++s) {
    const Seq q = SeqOf(p, s);
    if (q.q_len == 0 || kv_heads == 0 || UsesGemm(p, config, q)) continue;
    const int64_t tile = std::min(q.q_len, config.q_tile_tokens);
    const int64_t heads = std::clamp<int64_t>(config.task_rows / std::max<int64_t>(tile * group, 1), 1, kv_heads);
    // Keys the sequence's rows see, for the split.
    int64_t lo = 0, hi = 0, unused = 0;
    VisibleKeys(p, q, 0, &lo, &unused);
    VisibleKeys(p, q, q.q_len - 1, &unused, &hi);
    int64_t first = 0, splits = 1;
    if (q.q_len <= config.q_tile_tokens && config.split_kv > 0 && hi > lo) {
      first = lo / config.split_kv;
      splits = CeilDiv(hi, config.split_kv) - first;
    }
    if (splits > 1) {
      split_of[s] = static_cast<int64_t>(split_seqs.size());
      split_seqs.push_back({s, splits, records});
      records += splits * q.q_len * q_heads;
    }
    for (int64_t t0 = 0; t0 < q.q_len; t0 += tile) {
      for (int64_t g0 = 0; g0 < kv_heads; g0 += heads) {
        for (int64_t c = 0; c < splits; ++c) {
          const int64_t k0 = splits > 1 ? (first + c) * config.split_kv : 0;
          const int64_t k1 = splits > 1 ? k0 + config.split_kv : q.kv_len;
          tasks.push_back({s, t0, std::min(t0 + tile, q.q_len), g0, std::min(g0 + heads, kv_heads), k0, k1,
                           splits > 1 ? c : -1});
        }
      }
    }
  }
  // Longest first, so the last tasks to start are short (the order does not change the bits).
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    return (a.t1 - a.t0) * (a.k1 - a.k0) > (b.t1 - b.t0) * (b.k1 - b.k0);
  });
  LargeBuffer<float> partials(records * (d + 2), LargeBuffer<float>::kUninitialized);
  std::atomic<int64_t> next_task{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  ParallelFor(0, num_tasks, 1, [&](int64_t, int64_t) {
    for (int64_t i = next_task.fetch_add(1); i < num_tasks; i = next_task.fetch_add(1)) {
      const Task& task = tasks[i];
      const SplitSeq* split_seq = task.split >= 0 ? &split_seqs[split_of[task.seq]] : nullptr;
      RunTask(p, config, k, task, split_seq, partials.data());
    }
  });
  // The long sequences, one GEMM call each (each spreads over the threads itself).
  for (int64_t s = 0; s < active; ++s) {
    const Seq q = SeqOf(p, s);
    if (q.q_len == 0 || kv_heads == 0 || !UsesGemm(p, config, q)) continue;
    status = RunGemmSequence(p, s, q);
    if (!status.ok()) return status;
  }
  // The split rows, each merged in split order; then the padding tokens.
  const int64_t num_split = static_cast<int64_t>(split_seqs.size());
  ParallelFor(0, num_split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(d));
    for (int64_t i = begin; i < end; ++i) {
      const SplitSeq& split = split_seqs[i];
      const Seq q = SeqOf(p, split.seq);
      const int64_t rows = q.q_len * q_heads;
      for (int64_t r = 0; r < rows; ++r) {
        MergeRow(p, partials.data() + (split.record + r) * (d + 2), split.splits, rows * (d + 2), q.q0 + r / q_heads,
                 r % q_heads, acc.data());
      }
    }
  });
  const int64_t used = p.cu_q_lens[active];
  for (int64_t t = used; t < tokens; ++t) ZeroToken(p, t);
  // Active tokens of sequences with no kv heads to attend (Hkv = 0 has no rows) need nothing.
  return Status::Ok();
}

}  // namespace tokamax
