// The decode row path of the forward (ForwardRowTask): few query rows against a long KV cache,
// K and V rows read in place in memory order, for every kv head in one task.
#include <algorithm>

#include "csrc/ops/dot_product_attention/dot_product_attention_internal.h"

namespace tokamax {
namespace attention {
namespace {

// The row path walks a tile in runs of this many keys, every head of a run before the next
// run: the rows of one key for all kv heads are adjacent, so K and V are read in memory order
// (each page whole, once). Walking the tile head by head instead visits every page once per
// head, rows a page apart, which neither the TLB nor the hardware prefetchers follow: that ran
// at half the bandwidth.
constexpr int64_t kRowRunKeys = 16;

// Asks for x's rows [first, last) of kv head h into L2 (prefetcht1) at once: the row path's
// prefetch where the products cannot spread it (for_runs). The row path reads one run ahead,
// the rows of one head a few KiB apart, which the hardware prefetchers do not follow far enough
// to hide DRAM's latency; into L1 (prefetcht0) the 16 rows of a run, a page apart in an fp32
// cache, evict each other from their L1 sets. Measured on Zen 4 (S=4096, N=32, K=8, in one
// process): bf16 1.07 -> 0.55 ms, fp32 1.30 -> 1.04 ms; into L1 both were slower.
// Always inlined: as a call, GCC's IPA finds the function free of side effects (a prefetch has
// none it models) and deletes every call to it.
[[gnu::always_inline]] inline void PrefetchRowsToL2(const StridedView<4>& x, int64_t b, int64_t first, int64_t last,
                                                    int64_t h) {
  const int64_t bytes = x.sizes[3] * DTypeSize(x.dtype);
  for (int64_t r = first; r < last; ++r) {
    const char* row = static_cast<const char*>(x.At(b, r, h, 0));
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset, 0, 2);
  }
}

}  // namespace

void ForwardRowTask(const DotProductAttentionParams& p, const Dims& d, const Kernels& k,
                    const DotProductAttentionConfig& config, const TaskRows& task, int64_t kv_begin, int64_t kv_end,
                    int64_t split, SplitPartials* partials, TaskScratch& s) {
  TaskRows rows = task;
  rows.kv_head = 0;
  rows.group = d.q_heads;
  const int64_t count = rows.count(), cols = RoundUp(count, 16), block = config.block_kv;
  const int64_t head_dim = d.head_dim, value_dim = d.value_dim;
  // bf16 q, k and v with head dims of whole 32-element steps take the tier's bf16 row products
  // where it has them (avx512bf16), with q's rows as they are and the scale applied to st.
  const bool bf16_rows = k.rows->key_dots_bf16 != nullptr && p.q.dtype == DType::kBFloat16 &&
                         p.k.dtype == DType::kBFloat16 && p.v.dtype == DType::kBFloat16 && head_dim % 32 == 0 &&
                         value_dim % 32 == 0;
  float* q = nullptr;  // row r: scale · q[t(r), n(r)]
  uint16_t* q_bf16 = nullptr;  // row r: q[t(r), n(r)]
  if (bf16_rows) {
    q_bf16 = Scratch<uint16_t>(s, kQBf16Rows, count * head_dim);
    GatherRowsBf16(p.q, rows, q_bf16, head_dim);
  } else {
    q = Scratch<float>(s, kQRows, count * head_dim);
    GatherRows(*k.softmax, p.q, rows, head_dim, p.scale, q, head_dim);
  }
  float* st = Scratch<float>(s, kSt, block * cols);
  float* acc = Scratch<float>(s, kAcc, count * value_dim);
  float* max = Scratch<float>(s, kMax, cols);
  float* sum = Scratch<float>(s, kSum, cols);
  float* sub = Scratch<float>(s, kSub, cols);
  float* alpha = Scratch<float>(s, kAlpha, cols);
  float* tile_max = Scratch<float>(s, kTileMax, cols);
  // key_dots writes the real columns only; the softmax reads all of them, so the padding
  // columns start finite (and stay so: exp of finite values).
  std::fill(st, st + block * cols, 0.0f);
  std::fill(acc, acc + count * value_dim, 0.0f);
  std::fill(max, max + cols, kNegInf);
  std::fill(sum, sum + cols, 0.0f);
  ComputeRowMasks(p.masks, rows, d.kv_len, &s.row_masks);
  ForEachVisibleTile(p.masks, s.row_masks, rows, kv_begin, kv_end, block,
                     [&](int64_t s0, TileVisibility visibility, int64_t keys) {
    // run(h, first row of (kv head h, position), j0, keys of the run, next) over x's runs, in
    // memory order: every head of a run before the next run when one key's heads are adjacent
    // ([B, S, K, H]), every run of a head before the next head when a head's keys are
    // ([B, K, S, H] storage passed as a transposed view, the usual KV-cache layout). `next` is
    // the rows read after these: the head's next run; after its last, the next head's first
    // (heads outer), else `then`'s first run from key then_s0 (V's after K's; after V's, the next
    // tile's K). The products prefetch them as they go, one request beside each vector they
    // load, when they have the run's shape; otherwise they are prefetched here at once.
    auto for_runs = [&](const StridedView<4>& x, const StridedView<4>& then, int64_t then_s0, int64_t then_end,
                        auto&& run) {
      const bool heads_outer = x.strides[2] > x.strides[1];
      const int64_t runs = CeilDiv(keys, kRowRunKeys);
      auto visit = [&](int64_t h, int64_t run_index) {
        const int64_t j0 = run_index * kRowRunKeys;
        const int64_t n = std::min(kRowRunKeys, keys - j0);
        const StridedView<4>* nx = &x;
        int64_t next_h = h, next = s0 + j0 + kRowRunKeys, next_end = s0 + keys;
        if (run_index + 1 == runs) {
          if (heads_outer && h + 1 < d.kv_heads) {
            next_h = h + 1;
            next = s0;
          } else {
            nx = &then;
            next_h = heads_outer ? 0 : h;
            next = then_s0;
            next_end = then_end;
          }
        }
        next_end = std::min(next + kRowRunKeys, next_end);
        const bool spread = next_end - next == n && nx->dtype == x.dtype && nx->strides[1] == x.strides[1] &&
                            nx->sizes[3] == x.sizes[3];
        const void* next_rows = nullptr;
        if (spread) {
          next_rows = nx->At(rows.b, next, next_h, 0);
        } else if (next < next_end) {
          PrefetchRowsToL2(*nx, rows.b, next, next_end, next_h);
        }
        for (int64_t pos = 0; pos < rows.positions; ++pos) run(h, pos * d.q_heads + h * d.group, j0, n, next_rows);
      };
      if (heads_outer) {
        for (int64_t h = 0; h < d.kv_heads; ++h) {
          for (int64_t run_index = 0; run_index < runs; ++run_index) visit(h, run_index);
        }
      } else {
        for (int64_t run_index = 0; run_index < runs; ++run_index) {
          for (int64_t h = 0; h < d.kv_heads; ++h) visit(h, run_index);
        }
      }
    };
    for_runs(p.k, p.v, s0, s0 + keys, [&](int64_t h, int64_t r0, int64_t j0, int64_t n, const void* next) {
      const void* key = p.k.At(rows.b, s0 + j0, h, 0);
      if (bf16_rows) {
        k.rows->key_dots_bf16(static_cast<const uint16_t*>(key), p.k.strides[1], n, head_dim,
                                 q_bf16 + r0 * head_dim, head_dim, d.group, p.scale, st + j0 * cols + r0, cols,
                                 static_cast<const uint16_t*>(next));
      } else {
        k.rows->key_dots(p.k.dtype, key, p.k.strides[1], n, head_dim, q + r0 * head_dim, head_dim, d.group,
                            st + j0 * cols + r0, cols, next);
      }
    });
    FinishLogits(p, k, rows, s.row_masks, s0, keys, visibility, st, cols, nullptr);
    UpdateRunningMax(*k.softmax, st, keys, cols, cols, max, sum, alpha, sub, tile_max);
    k.softmax->exp_columns(st, keys, cols, cols, sub, sum);
    k.softmax->scale_rows(acc, value_dim, count, value_dim, alpha);
    for_runs(p.v, p.k, s0 + block, kv_end, [&](int64_t h, int64_t r0, int64_t j0, int64_t n, const void* next) {
      const void* value = p.v.At(rows.b, s0 + j0, h, 0);
      if (bf16_rows) {
        k.rows->accumulate_values_bf16(st + j0 * cols + r0, cols, n, d.group, static_cast<const uint16_t*>(value),
                                          p.v.strides[1], value_dim, acc + r0 * value_dim, value_dim,
                                          static_cast<const uint16_t*>(next));
      } else {
        k.rows->accumulate_values(p.v.dtype, st + j0 * cols + r0, cols, n, d.group, value, p.v.strides[1],
                                     value_dim, acc + r0 * value_dim, value_dim, next);
      }
    });
  });
  for (int64_t r = 0; r < count; ++r) {
    FinishRow(p, d, rows.b, rows.t(r), rows.n(r), acc + r * value_dim, max[r], sum[r], split, partials);
  }
}

}  // namespace attention
}  // namespace tokamax
