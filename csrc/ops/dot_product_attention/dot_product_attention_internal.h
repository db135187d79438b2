// The pieces the dot_product_attention kernel files share (forward, decode, backward, tiles):
// a task's rows, its masks and visible tiles, the logits' epilogue, scratch and kernel tables.
// Private to csrc/ops/dot_product_attention; the op's API is dot_product_attention.h.
//
// A GEMM task owns one kv head of one batch and a block of query positions; its tile rows are
// the (position, query head) pairs of that block for all N/K query heads that share the kv
// head, so each K/V tile is packed once per group (GQA without repeating K/V). Decode-sized
// calls take the row path instead (ForwardRowTask): one task per key range for every head,
// dot products on K and V rows in place. Logits are kept transposed, st[key][row]: the GEMM
// st = K · (scale·Q)ᵀ takes K as its packed A operand (the natural layout of a [S, H] view) and
// Q, packed once per task, as B; per-row softmax reductions then run down columns. Tiles that
// every causal/window/length/segment mask, or the bool mask, hides are skipped before any compute.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "csrc/core/gemm/bf16_gemm.h"
#include "csrc/core/gemm/gemm.h"
#include "csrc/core/base/int_math.h"
#include "csrc/core/softmax/softmax_kernels.h"
#include "csrc/core/base/status.h"
#include "csrc/core/base/strided_view.h"
#include "csrc/core/runtime/scratch_arena.h"
#include "csrc/ops/dot_product_attention/attention_masks.h"
#include "csrc/ops/dot_product_attention/attention_row_products.h"
#include "csrc/ops/dot_product_attention/dot_product_attention.h"

namespace tokamax {
namespace attention {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A row stride, in floats, of at least `floats` and an odd number of 64-byte lines, for the
// [key][row] logits tiles that P·V and dQ = dS·K read in place as A, one key's rows per depth
// step. At an even stride those steps fall into a fraction of the L1 sets (96 rows, 6 lines:
// half of them) and evict the B panel; an odd one spreads them over every set.
inline int64_t SetSpreadingLd(int64_t floats) {
  constexpr int64_t kLineFloats = 16;
  const int64_t lines = CeilDiv(floats, kLineFloats);
  return (lines % 2 == 0 ? lines + 1 : lines) * kLineFloats;
}

struct Dims {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, group, head_dim, value_dim;
};

inline Dims DimsOf(const DotProductAttentionParams& p) {
  Dims d;
  d.batch = p.q.sizes[0];
  d.q_len = p.q.sizes[1];
  d.kv_len = p.k.sizes[1];
  d.q_heads = p.q.sizes[2];
  d.kv_heads = p.k.sizes[2];
  d.group = d.kv_heads > 0 ? d.q_heads / d.kv_heads : 0;
  d.head_dim = p.q.sizes[3];
  d.value_dim = p.v.sizes[3];
  return d;
}

// view[i0, i1, i2, e] = scale * values[e] for e < count, converted to the view's dtype: the
// GEMM's one store (GemmKernels::store_c with a GemmEpilogue's scale), vectorized in the tier's
// file. values is rewritten (scaled in place).
void StoreRow(const GemmKernels& gemm, const MutableStridedView<4>& view, int64_t i0, int64_t i1, int64_t i2,
              float* values, int64_t count, float scale);

// The rows of a task: (position t, query head n) for t in [t0, t0 + positions), n in the group.
struct TaskRows {
  int64_t b = 0, kv_head = 0, t0 = 0, positions = 0, group = 0;
  int64_t count() const { return positions * group; }
  int64_t t(int64_t r) const { return t0 + r / group; }
  int64_t n(int64_t r) const { return kv_head * group + r % group; }
};

// dst[r * ld + h] = scale · X[row r][h] for h < cols, zero for cols <= h < ld: the task's rows
// of X (q, dout or out, gathered per TaskRows) as contiguous fp32 rows. Transposed by
// SoftmaxKernels::transpose_panels, they are the GEMMs' B operand Xᵀ; read in place, X itself.
void GatherRows(const SoftmaxKernels& kernels, const StridedView<4>& x, const TaskRows& rows, int64_t cols, float scale,
                float* dst, int64_t ld);

// The task's rows of a bf16 X as they are, row r at dst + r * ld (the bf16 row products' query).
void GatherRowsBf16(const StridedView<4>& x, const TaskRows& rows, uint16_t* dst, int64_t ld);

struct TaskScratch;

// B(h, r) = X[row r][h] for the task's rows of a bf16 X (q or dout), zero for count <= r <
// cols: X's rows transposed into the VNNI panels of bf16_gemm.h, depth X's head dim (even). Each
// 16 rows are gathered contiguous (read whole, once), then transposed as 32-bit pairs; exact.
// `s`'s slot kRowsVnniBlock holds the 16 rows.
void PackRowsVnni(const StridedView<4>& x, const TaskRows& rows, int64_t cols, uint16_t* dst, TaskScratch& s);

// What a task's rows can see of kv tile [s0, s1).
enum class TileVisibility { kNone, kPartial, kFull };

struct RowMasks {
  std::vector<attention::KeyRange> ranges;  // per row
  int64_t max_end = 0;                      // of all rows' ranges: no row sees a key at or past it
  int32_t min_segment = 0, max_segment = 0;  // of the task's query positions (when segmented)
  std::vector<float> lo, hi;                // per column: the current tile's visible rows (SetTileRanges)
};

// The slots of a task's scratch, forward (ForwardTask, ForwardRowTask) and backward: fp32, or
// bf16 for the bf16 engines' operands.
enum TaskScratchSlot : int {
  kQPanels, kQRows, kKPanels, kSt, kVPanels, kAcc, kMax, kSum, kSub, kAlpha, kTileMax, kOutRows,
  kQVnni, kPVnni, kQBf16Rows, kRowsVnniBlock,
  kDoPanels, kDoRows, kQBPanels, kDoBPanels, kKRows, kDpt, kCapSlope, kAPanels, kDqAcc, kLseSub, kDelta,
  kDoVnni, kQRowVnni, kDoRowVnni, kTileRows, kTileVnni, kNumTaskScratchSlots
};
static_assert(kNumTaskScratchSlots <= ScratchLease::kSlots, "one lease's slots");

// One thread's scratch for its tasks of one call: the thread's ScratchLease (scratch_arena.h),
// taken once per ParallelFor chunk, so steady-state calls do not allocate, and the row masks
// (a few small vectors, freed with the chunk).
struct TaskScratch {
  ScratchLease lease;
  RowMasks row_masks;
  std::vector<int64_t> dead_rows;  // backward: the block's rows that see no key
  std::vector<float> renorm;       // backward: per column, 1 / P's row sum where lse is coarse, else 1
};

template <typename T>
T* Scratch(TaskScratch& s, TaskScratchSlot slot, int64_t count) {
  return s.lease.Get<T>(slot, count);
}

// A tile of `rows` x `ld` floats that TileGemm reads in place as A (InPlaceA): whole mr-row
// panels may read up to mr - 1 floats past the last row's `cols`, so one spare row follows,
// zeroed; what it holds only feeds accumulator rows that are never stored.
float* InPlaceTileScratch(TaskScratch& s, TaskScratchSlot slot, int64_t rows, int64_t ld);

void ComputeRowMasks(const AttentionMasks& m, const TaskRows& rows, int64_t kv_len, RowMasks* out);

// A bool mask every row of which shows one run of keys (a causal, sliding-window or padding mask
// passed as a tensor) as those runs, held in `runs`: the kernels then treat it like is_causal's
// ranges (hidden tiles skipped, diagonal tiles clipped, the mask applied across rows, no byte
// read per logit). The same visible keys, so the same results. `m` itself when some row is not
// one run, or there is no mask.
AttentionMasks FoldMaskRuns(const AttentionMasks& m, const Dims& d, std::vector<int64_t>* runs);

// The keys of tile [s0, s0 + keys) that some row can see end by max_end: the rest is left out
// of the products (causal diagonal tiles shrink to the block's last position).
inline int64_t ClippedKeys(const RowMasks& rm, int64_t s0, int64_t keys) { return std::min(keys, rm.max_end - s0); }

// Each row's visible keys of tile [s0, s0 + keys) relative to s0, as mask_columns takes them;
// once per tile, shared by every head. Padding columns (r >= count) see the whole tile.
void SetTileRanges(RowMasks& rm, int64_t count, int64_t s0, int64_t keys);

// kNone when no row sees a key of the tile (ranges, segments or the bool mask), kFull when every
// row sees every key (no mask to apply), else kPartial.
TileVisibility ClassifyTile(const AttentionMasks& m, const RowMasks& rm, const TaskRows& rows, int64_t s0, int64_t s1);

// Calls fn(s0, visibility, keys) for each kv tile [s0, s0 + block) of [begin, end) that some of
// a task's rows see, skipping the rest: keys is clipped to the last key any row sees, and a
// partial tile has its per-row ranges set for the masks first.
template <typename Fn>
void ForEachVisibleTile(const AttentionMasks& m, RowMasks& rm, const TaskRows& rows, int64_t begin, int64_t end,
                        int64_t block, Fn&& fn) {
  const int64_t count = rows.count();
  for (int64_t s0 = begin; s0 < end; s0 += block) {
    const int64_t s1 = std::min(s0 + block, end);
    const TileVisibility visibility = ClassifyTile(m, rm, rows, s0, s1);
    if (visibility == TileVisibility::kNone) continue;
    const int64_t keys = ClippedKeys(rm, s0, s1 - s0);
    if (visibility == TileVisibility::kPartial) SetTileRanges(rm, count, s0, keys);
    fn(s0, visibility, keys);
  }
}

struct Kernels {
  const GemmKernels* gemm;
  const SoftmaxKernels* softmax;
  const RowProducts* rows;  // the decode path's row products
  Bf16Products bf16;  // the tier's bf16 product engine, if it has one (bf16_gemm.h)
};

Status GetKernels(Kernels* kernels);

// What every entry point does first: validates `config` (and that the tile of one task, rows
// (block_q x group) by block_kv keys, fits the scratch bound) and looks up the tier's kernels.
Status BeginCall(const DotProductAttentionParams& p, const DotProductAttentionConfig& config, Kernels* kernels);

// Turns st[key][row] = scale·q·k of tile [s0, s0 + keys) into final logits: + bias, soft cap,
// then -inf where masked. When `cap_slope_out` is set it receives the soft cap's derivative
// 1 - tanh²(logit / cap) (backward), computed apart from tanh: from a float tanh it would cancel
// where the cap saturates (at |logit / cap| = 6.7, 1 - t² has 1e-2 relative error).
void FinishLogits(const DotProductAttentionParams& p, const Kernels& k, const TaskRows& rows, const RowMasks& rm,
                  int64_t s0, int64_t keys, TileVisibility visibility, float* st, int64_t ld, float* cap_slope_out);

// The bf16 product engine (AMX tiles or vdpbf16ps) takes bf16 q, k and v whose head dims fit
// whole tiles; anything else keeps the fp32 micro-kernels.
bool UseBf16Products(const DotProductAttentionParams& p, const Kernels& k);

// Where a task's unnormalised result goes when the kv sequence is split: per split, row-major
// [B, N, T] rows of value_dim floats, and the running max and sum of each row.
struct SplitPartials {
  std::vector<float> out, max, sum;
  int64_t Row(const Dims& d, int64_t split, int64_t b, int64_t n, int64_t t) const {
    return ((split * d.batch + b) * d.q_heads + n) * d.q_len + t;
  }
};

// One finished row of a task: to the output (and logsumexp), or to its split's partials.
void FinishRow(const DotProductAttentionParams& p, const Dims& d, int64_t b, int64_t t, int64_t n,
               const float* row_acc, float row_max, float row_sum, int64_t split, SplitPartials* partials);

// A row-path task (UseRowDots): keys [kv_begin, kv_end) of one batch for every kv head. Its
// rows are the task's positions times all N query heads, r = position · N + n (TaskRows over kv
// head 0 with group N), so the logits' epilogue, masks and online softmax run once per tile for
// every head, vectorized across N columns with no padding between heads; the two products run
// per (kv head, position) on that head's `group` adjacent columns, K and V rows streamed in
// place in runs of kRowRunKeys keys across the heads.
void ForwardRowTask(const DotProductAttentionParams& p, const Dims& d, const Kernels& k,
                    const DotProductAttentionConfig& config, const TaskRows& task, int64_t kv_begin, int64_t kv_end,
                    int64_t split, SplitPartials* partials, TaskScratch& s);

}  // namespace attention
}  // namespace tokamax
