// The dot_product_attention CPU kernels: flash attention forward (online softmax over kv tiles)
// and FlashAttention-2 backward (probabilities recomputed from the saved logsumexp).
//
// A GEMM task owns one kv head of one batch and a block of query positions; its tile rows are
// the (position, query head) pairs of that block for all N/K query heads that share the kv
// head, so each K/V tile is packed once per group (GQA without repeating K/V). Decode-sized
// calls take the row path instead (ForwardRowTask): one task per key range for every head,
// dot products on K and V rows in place. Logits are kept
// transposed, st[key][row]: the GEMM st = K · (scale·Q)ᵀ takes K as its packed A operand (the
// natural layout of a [S, H] view) and Q, packed once per task, as B; per-row softmax
// reductions then run down columns. Tiles that every causal/window/length/segment mask hides
// are skipped before any compute.
#include "csrc/ops/dot_product_attention/dot_product_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "csrc/core/bf16_gemm.h"
#include "csrc/core/gemm.h"
#include "csrc/core/int_math.h"
#include "csrc/core/isa.h"
#include "csrc/core/large_buffer.h"
#include "csrc/core/parallel.h"
#include "csrc/core/softmax_kernels.h"
#include "csrc/ops/dot_product_attention/attention_masks.h"

namespace tokamax {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A row stride, in floats, of at least `floats` and an odd number of 64-byte lines, for the
// [key][row] logits tiles that P·V and dQ = dS·K read in place as A, one key's rows per depth
// step. At an even stride those steps fall into a fraction of the L1 sets (96 rows, 6 lines:
// half of them) and evict the B panel; an odd one spreads them over every set.
int64_t SetSpreadingLd(int64_t floats) {
  constexpr int64_t kLineFloats = 16;
  const int64_t lines = CeilDiv(floats, kLineFloats);
  return (lines % 2 == 0 ? lines + 1 : lines) * kLineFloats;
}

struct Dims {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, group, head_dim, value_dim;
};

Dims DimsOf(const DotProductAttentionParams& p) {
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

// The tile of one task, rows (block_q x group) by block_kv keys, must fit the scratch bound.
Status CheckTile(const DotProductAttentionConfig& config, int64_t group) {
  constexpr int64_t kMaxTileFloats = int64_t{1} << 24;  // 64 MiB of fp32 logits
  if (config.block_q * group * config.block_kv > kMaxTileFloats) {
    return Status::Error("dot_product_attention config: block_q * (query heads per kv head) * block_kv must be "
                         "at most 2^24, got " + std::to_string(config.block_q) + " * " + std::to_string(group) +
                         " * " + std::to_string(config.block_kv));
  }
  return Status::Ok();
}

// view[i0, i1, i2, e] = scale * values[e] for e < count, converted to the view's dtype (one
// dtype dispatch per row, not per element).
void StoreRow(const MutableStridedView<4>& view, int64_t i0, int64_t i1, int64_t i2, const float* values,
              int64_t count, float scale) {
  DispatchDType(view.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* dst = static_cast<T*>(view.data) + i0 * view.strides[0] + i1 * view.strides[1] + i2 * view.strides[2];
    const int64_t step = view.strides[3];
    for (int64_t e = 0; e < count; ++e) StoreFromFloat(dst + e * step, scale * values[e]);
    return 0;
  });
}

// Grow-only per-thread scratch (fp32, or bf16 for the bf16 engines' operands); resized, never shrunk, so
// steady-state calls do not allocate.
template <typename T>
T* Scratch(std::vector<T>& buffer, int64_t count) {
  if (static_cast<int64_t>(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

// A tile of `rows` x `ld` floats that TileGemm reads in place as A (InPlaceA): whole mr-row
// panels may read up to mr - 1 floats past the last row's `cols`, so one spare row follows,
// zeroed; what it holds only feeds accumulator rows that are never stored.
float* InPlaceTileScratch(std::vector<float>& buffer, int64_t rows, int64_t ld) {
  float* tile = Scratch(buffer, (rows + 1) * ld);
  std::fill(tile + rows * ld, tile + (rows + 1) * ld, 0.0f);
  return tile;
}

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
                float* dst, int64_t ld) {
  DispatchDType(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t step = x.strides[3];
    for (int64_t r = 0; r < rows.count(); ++r) {
      const T* src = static_cast<const T*>(x.At(rows.b, rows.t(r), rows.n(r), 0));
      float* out = dst + r * ld;
      if (step == 1) {
        kernels.widen_row(x.dtype, src, cols, scale, out);
      } else {
        for (int64_t h = 0; h < cols; ++h) out[h] = scale * LoadAsFloat(src + h * step);
      }
      std::fill(out + cols, out + ld, 0.0f);
    }
    return 0;
  });
}

// The task's rows of a bf16 X as they are, row r at dst + r * ld (the bf16 row products' query).
void GatherRowsBf16(const StridedView<4>& x, const TaskRows& rows, uint16_t* dst, int64_t ld) {
  for (int64_t r = 0; r < rows.count(); ++r) {
    const uint16_t* src = static_cast<const uint16_t*>(x.At(rows.b, rows.t(r), rows.n(r), 0));
    CopyBf16(src, 0, x.strides[3], 1, x.sizes[3], /*transpose=*/false, dst + r * ld, ld);
  }
}

// B(h, r) = X[row r][h] for the task's rows of a bf16 X (q or dout), zero for count <= r <
// cols: X's rows transposed into the VNNI panels of bf16_gemm.h, depth X's head dim (even). Each
// 16 rows are gathered contiguous (read whole, once), then transposed as 32-bit pairs; exact.
void PackRowsVnni(const StridedView<4>& x, const TaskRows& rows, int64_t cols, uint16_t* dst) {
  const int64_t depth = x.sizes[3];
  for (int64_t r0 = 0; r0 < cols; r0 += kBf16TileRows) {
    const uint16_t* vectors[kBf16TileRows] = {};
    for (int64_t j = 0; j < kBf16TileRows && r0 + j < rows.count(); ++j) {
      const int64_t r = r0 + j;
      vectors[j] = static_cast<const uint16_t*>(x.At(rows.b, rows.t(r), rows.n(r), 0));
    }
    PackVnniFromBf16Vectors(vectors, x.strides[3], depth, depth, dst + r0 * depth);
  }
}

// The [S, C] matrix of kv head `kv_head` of batch b (key or value) as a GEMM operand.
ConstMatrix KvMatrix(const StridedView<4>& x, int64_t b, int64_t kv_head, int64_t s0, int64_t rows) {
  return {x.At(b, s0, kv_head, 0), x.dtype, rows, x.sizes[3], x.strides[1], x.strides[3]};
}

// A TileGemm operand: mr-row panels of A or nr-wide panels of B; depth step p of panel i is
// at data + i * panel_stride + p * step. Packed panels have step mr (A) or nr (B); A with a
// larger step is an fp32 tile read in place.
struct Panels {
  const float* data;
  int64_t step;
  int64_t panel_stride;
};

// c (+)= a · b over whole tiles: `row_panels` panels of A times `col_panels` panels of B.
void TileGemm(const GemmKernels& kernels, int64_t depth, const Panels& a, int64_t row_panels, const Panels& b,
              int64_t col_panels, float* c, int64_t ldc, bool accumulate) {
  const int64_t mr = kernels.mr, nr = kernels.nr;
  for (int64_t qi = 0; qi < col_panels; ++qi) {
    for (int64_t pi = 0; pi < row_panels; ++pi) {
      kernels.micro_f32(depth, a.data + pi * a.panel_stride, a.step, b.data + qi * b.panel_stride, b.step,
                        c + pi * mr * ldc + qi * nr, ldc, accumulate);
    }
  }
}

// K or V of every (batch, kv head) as a GEMM operand, tile by tile (A: mr-row panels, depth =
// head dim; B: nr-wide panels, depth = keys). With `pack_all`, every tile is packed once per
// call: packing transposes K, the costliest copy of the kernel, and doing it once instead of
// once per query block pays whenever more than one query block reads each tile. Memory: an
// fp32 copy of K or V (O(S), never T·S). Otherwise Tile() packs the tile it is asked for.
class KvTiles {
 public:
  KvTiles(const GemmKernels& gemm, const StridedView<4>& x, int64_t block, bool as_a, bool pack_all)
      : gemm_(gemm), x_(x), block_(block), as_a_(as_a) {
    const int64_t batch = x.sizes[0], kv_len = x.sizes[1], kv_heads = x.sizes[2], cols = x.sizes[3];
    tiles_per_head_ = CeilDiv(kv_len, block);
    tile_floats_ = as_a ? RoundUp(block, gemm.mr) * cols : block * RoundUp(cols, gemm.nr);
    if (!pack_all) return;
    const int64_t tiles = batch * kv_heads * tiles_per_head_;
    // Every float a tile read uses is written below.
    data_ = LargeBuffer<float>(tiles * tile_floats_, LargeBuffer<float>::kUninitialized);
    ParallelFor(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t head = i / tiles_per_head_, s0 = (i % tiles_per_head_) * block;
        PackInto(head / kv_heads, head % kv_heads, s0, std::min(block, kv_len - s0), data_.data() + i * tile_floats_);
      }
    });
  }
  // Floats of scratch that Tile() may use.
  int64_t tile_floats() const { return tile_floats_; }
  // Keys [s0, s0 + keys) of kv head `kv_head` of batch b (s0 a tile start, keys at most the
  // tile's): the packed copy, or packed into `scratch` now.
  Panels Tile(int64_t b, int64_t kv_head, int64_t s0, int64_t keys, float* scratch) const {
    const float* data = scratch;
    int64_t depth_keys = keys;  // the keys a B panel holds
    if (data_.data() != nullptr) {
      data = data_.data() + ((b * x_.sizes[2] + kv_head) * tiles_per_head_ + s0 / block_) * tile_floats_;
      depth_keys = std::min(block_, x_.sizes[1] - s0);
    } else {
      PackInto(b, kv_head, s0, keys, scratch);
    }
    const int64_t cols = x_.sizes[3];
    return as_a_ ? Panels{data, gemm_.mr, gemm_.mr * cols} : Panels{data, gemm_.nr, depth_keys * gemm_.nr};
  }

 private:
  void PackInto(int64_t b, int64_t kv_head, int64_t s0, int64_t keys, float* dst) const {
    const ConstMatrix m = KvMatrix(x_, b, kv_head, s0, keys);
    if (as_a_) {
      gemm_.pack_a(m, 0, keys, 0, x_.sizes[3], dst);
    } else {
      gemm_.pack_b(m, 0, keys, 0, x_.sizes[3], dst);
    }
  }

  const GemmKernels& gemm_;
  StridedView<4> x_;
  int64_t block_, tiles_per_head_ = 0, tile_floats_ = 0;
  bool as_a_;
  LargeBuffer<float> data_;  // empty unless pack_all
};

// A fp32 tile x[p][i] (p < depth, ld floats apart) read in place as A panels: row i, depth p.
Panels InPlaceA(const float* x, int64_t ld, int64_t mr) { return {x, ld, mr}; }

// Packed A panels of `depth` (pack_a's layout).
Panels PackedA(const float* x, int64_t depth, int64_t mr) { return {x, mr, mr * depth}; }

// Packed B panels of `depth` (pack_b's layout).
Panels PackedB(const float* x, int64_t depth, int64_t nr) { return {x, nr, depth * nr}; }

// A bf16 K or V of every (batch, kv head) as an A operand of the bf16 product engine
// (bf16_gemm.h), copied once per call (O(S) memory), in one of two layouts:
//  - kRows: row-major [S + 16 rounded up to 16][C] (K in K·Qᵀ, V in V·dOᵀ: 16 keys per tile,
//    read in whole tiles from any tile start, a multiple of 8);
//  - kTransposed: [C][ld], ld that row count plus 32 (Vᵀ in Vᵀ·Pᵀ, Kᵀ in Kᵀ·dS: read 32 keys
//    deep from any tile start).
// Padding is zero, so every tile read stays in the copy and adds nothing.
class Bf16Operand {
 public:
  enum Layout { kRows, kTransposed };
  Bf16Operand(const StridedView<4>& x, Layout layout) : x_(x), layout_(layout) {
    const int64_t batch = x.sizes[0], kv_len = x.sizes[1], kv_heads = x.sizes[2], width = x.sizes[3];
    rows_ = RoundUp(kv_len + kBf16TileRows, kBf16TileRows);
    ld_ = layout == kRows ? width : rows_ + 2 * kBf16TileRows;
    head_elements_ = layout == kRows ? rows_ * width : width * ld_;
    const int64_t heads = batch * kv_heads;
    data_ = LargeBuffer<uint16_t>(heads * head_elements_, LargeBuffer<uint16_t>::kUninitialized);
    ParallelFor(0, heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t head = begin; head < end; ++head) Pack(head / kv_heads, head % kv_heads, head);
    });
  }
  // kRows: the rows from key s0 on; kTransposed: the columns from key s0 on. ld() apart.
  const uint16_t* At(int64_t b, int64_t kv_head, int64_t s0) const {
    const uint16_t* head = data_.data() + (b * x_.sizes[2] + kv_head) * head_elements_;
    return head + (layout_ == kRows ? s0 * ld_ : s0);
  }
  int64_t ld() const { return ld_; }

 private:
  void Pack(int64_t b, int64_t kv_head, int64_t head) const {
    const int64_t kv_len = x_.sizes[1], width = x_.sizes[3];
    uint16_t* dst = data_.data() + head * head_elements_;
    const uint16_t* src = static_cast<const uint16_t*>(x_.At(b, 0, kv_head, 0));
    CopyBf16(src, x_.strides[1], x_.strides[3], kv_len, width, layout_ == kTransposed, dst, ld_);
    if (layout_ == kRows) {
      std::fill(dst + kv_len * ld_, dst + head_elements_, uint16_t{0});
      return;
    }
    for (int64_t c = 0; c < width; ++c) std::fill(dst + c * ld_ + kv_len, dst + (c + 1) * ld_, uint16_t{0});
  }

  StridedView<4> x_;
  Layout layout_;
  int64_t rows_ = 0, ld_ = 0, head_elements_ = 0;
  LargeBuffer<uint16_t> data_;
};

// What a task's rows can see of kv tile [s0, s1).
enum class TileVisibility { kNone, kPartial, kFull };

struct RowMasks {
  std::vector<attention::KeyRange> ranges;  // per row
  int64_t max_end = 0;                      // of all rows' ranges: no row sees a key at or past it
  int32_t min_segment = 0, max_segment = 0;  // of the task's query positions (when segmented)
  std::vector<float> lo, hi;                // per column: the current tile's visible rows (SetTileRanges)
};

void ComputeRowMasks(const AttentionMasks& m, const TaskRows& rows, int64_t kv_len, RowMasks* out) {
  out->ranges.resize(rows.count());
  out->max_end = 0;
  for (int64_t r = 0; r < rows.count(); ++r) {
    const attention::KeyRange range = attention::VisibleKeys(m, rows.b, rows.t(r), kv_len);
    out->ranges[r] = range;
    if (range.begin < range.end) out->max_end = std::max(out->max_end, range.end);
  }
  if (m.q_segment_ids != nullptr) {
    out->min_segment = std::numeric_limits<int32_t>::max();
    out->max_segment = std::numeric_limits<int32_t>::min();
    for (int64_t t = rows.t0; t < rows.t0 + rows.positions; ++t) {
      const int32_t id = attention::QuerySegment(m, rows.b, t);
      out->min_segment = std::min(out->min_segment, id);
      out->max_segment = std::max(out->max_segment, id);
    }
  }
}

// The keys of tile [s0, s0 + keys) that some row can see end by max_end: the rest is left out
// of the products (causal diagonal tiles shrink to the block's last position).
int64_t ClippedKeys(const RowMasks& rm, int64_t s0, int64_t keys) { return std::min(keys, rm.max_end - s0); }

// Each row's visible keys of tile [s0, s0 + keys) relative to s0, as mask_columns takes them;
// once per tile, shared by every head. Padding columns (r >= count) see the whole tile.
void SetTileRanges(RowMasks& rm, int64_t count, int64_t s0, int64_t keys) {
  const int64_t cols = RoundUp(count, 16);
  rm.lo.resize(cols);
  rm.hi.resize(cols);
  for (int64_t r = 0; r < cols; ++r) {
    const attention::KeyRange range = r < count ? rm.ranges[r] : attention::KeyRange{s0, s0 + keys};
    rm.lo[r] = static_cast<float>(std::clamp<int64_t>(range.begin - s0, 0, keys));
    rm.hi[r] = static_cast<float>(std::clamp<int64_t>(range.end - s0, 0, keys));
  }
}

TileVisibility ClassifyTile(const AttentionMasks& m, const RowMasks& rm, int64_t b, int64_t s0, int64_t s1) {
  bool any = false, all = true;
  for (const attention::KeyRange& range : rm.ranges) {
    const int64_t begin = std::max(range.begin, s0), end = std::min(range.end, s1);
    if (begin < end) any = true;
    if (begin > s0 || end < s1) all = false;
  }
  if (!any) return TileVisibility::kNone;
  if (m.q_segment_ids != nullptr) {
    int32_t lo = std::numeric_limits<int32_t>::max(), hi = std::numeric_limits<int32_t>::min();
    for (int64_t s = s0; s < s1; ++s) {
      const int32_t id = attention::KeySegment(m, b, s);
      lo = std::min(lo, id);
      hi = std::max(hi, id);
    }
    if (hi < rm.min_segment || lo > rm.max_segment) return TileVisibility::kNone;
  }
  return all && !attention::HasElementMasks(m) ? TileVisibility::kFull : TileVisibility::kPartial;
}

// Calls fn(s0, visibility, keys) for each kv tile [s0, s0 + block) of [begin, end) that some of
// a task's rows see, skipping the rest: keys is clipped to the last key any row sees, and a
// partial tile has its per-row ranges set for the masks first.
template <typename Fn>
void ForEachVisibleTile(const AttentionMasks& m, RowMasks& rm, int64_t b, int64_t count, int64_t begin, int64_t end,
                        int64_t block, Fn&& fn) {
  for (int64_t s0 = begin; s0 < end; s0 += block) {
    const int64_t s1 = std::min(s0 + block, end);
    const TileVisibility visibility = ClassifyTile(m, rm, b, s0, s1);
    if (visibility == TileVisibility::kNone) continue;
    const int64_t keys = ClippedKeys(rm, s0, s1 - s0);
    if (visibility == TileVisibility::kPartial) SetTileRanges(rm, count, s0, keys);
    fn(s0, visibility, keys);
  }
}

struct Kernels {
  const GemmKernels* gemm;
  const SoftmaxKernels* softmax;
  Bf16Products bf16;  // the tier's bf16 product engine, if it has one (bf16_gemm.h)
};

Status GetKernels(Kernels* kernels) {
  Isa isa;
  const Status status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  kernels->gemm = &GetGemmKernels(isa);
  kernels->softmax = &GetSoftmaxKernels(isa);
  kernels->bf16 = GetBf16Products(isa);
  return Status::Ok();
}

// Turns st[key][row] = scale·q·k of tile [s0, s0 + keys) into final logits: + bias, soft cap,
// then -inf where masked. When `tanh_out` is set it receives tanh(logit / cap) (backward).
void FinishLogits(const DotProductAttentionParams& p, const Kernels& k, const TaskRows& rows, const RowMasks& rm,
                  int64_t s0, int64_t keys, TileVisibility visibility, float* st, int64_t ld, float* tanh_out) {
  const int64_t count = rows.count();
  if (p.bias.data != nullptr) {
    for (int64_t r = 0; r < count; ++r) {
      for (int64_t j = 0; j < keys; ++j) {
        st[j * ld + r] += attention::LoadElement(p.bias, rows.b, rows.n(r), rows.t(r), s0 + j);
      }
    }
  }
  if (p.logits_soft_cap > 0.0f) {
    const float cap = p.logits_soft_cap, inv_cap = 1.0f / p.logits_soft_cap;
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t r = 0; r < count; ++r) {
        const float th = std::tanh(st[j * ld + r] * inv_cap);
        if (tanh_out != nullptr) tanh_out[j * ld + r] = th;
        st[j * ld + r] = cap * th;
      }
    }
  }
  if (visibility == TileVisibility::kFull) return;
  // Ranges (SetTileRanges), vectorized across rows.
  k.softmax->mask_columns(st, keys, ld, RoundUp(count, 16), rm.lo.data(), rm.hi.data());
  if (!attention::HasElementMasks(p.masks)) return;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t t = rows.t(r), n = rows.n(r);
    for (int64_t j = 0; j < keys; ++j) {
      if (!attention::ElementVisible(p.masks, rows.b, n, t, s0 + j)) st[j * ld + r] = kNegInf;
    }
  }
}

// ---- forward -------------------------------------------------------------------------------

// Where a task's unnormalised result goes when the kv sequence is split: per split, row-major
// [B, N, T] rows of value_dim floats, and the running max and sum of each row.
struct SplitPartials {
  std::vector<float> out, max, sum;
  int64_t Row(const Dims& d, int64_t split, int64_t b, int64_t n, int64_t t) const {
    return ((split * d.batch + b) * d.q_heads + n) * d.q_len + t;
  }
};

struct ForwardScratch {
  std::vector<float> q_panels, q_rows, k_panels, st, v_panels, acc, max, sum, sub, alpha, tile_max, out_rows;
  std::vector<uint16_t> q_vnni, p_vnni, q_bf16_rows;  // bf16 operands (engine; row path)
  RowMasks row_masks;
};

// Few rows (decode: one position times the group): a GEMM tile would be mostly padding and
// packing K would cost more than reading it, so the row path streams K and V rows in place.
// Taken when a single query block of few rows covers the whole query sequence.
bool UseRowDots(const DotProductAttentionParams& p, int64_t q_blocks, int64_t rows) {
  return q_blocks == 1 && rows <= kMaxRowDotRows && p.k.strides[3] == 1 && p.v.strides[3] == 1;
}

// The bf16 product engine (AMX tiles or vdpbf16ps) takes bf16 q, k and v whose head dims fit
// whole tiles; anything else keeps the fp32 micro-kernels.
bool UseBf16Products(const DotProductAttentionParams& p, const Kernels& k) {
  return k.bf16 && p.q.dtype == DType::kBFloat16 && p.k.dtype == DType::kBFloat16 && p.v.dtype == DType::kBFloat16 &&
         p.q.sizes[3] % kBf16TileDepth == 0 && p.v.sizes[3] % kBf16TileRows == 0;
}

// Its backward also multiplies over Hv (V·dOᵀ), so Hv must fill whole tile depths too.
bool UseBf16ProductsBackward(const DotProductAttentionGradParams& g, const Kernels& k) {
  return UseBf16Products(g.forward, k) && g.dout.dtype == DType::kBFloat16 &&
         g.forward.v.sizes[3] % kBf16TileDepth == 0;
}

void StoreOutputRow(const DotProductAttentionParams& p, int64_t b, int64_t t, int64_t n, const float* acc, float sum,
                    float max) {
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  DispatchDType(p.out.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* dst = static_cast<T*>(p.out.data) + b * p.out.strides[0] + t * p.out.strides[1] + n * p.out.strides[2];
    for (int64_t e = 0; e < p.out.sizes[3]; ++e) StoreFromFloat(dst + e * p.out.strides[3], acc[e] * inv);
    return 0;
  });
  if (p.lse != nullptr) {
    static_cast<float*>(p.lse)[b * p.lse_strides[0] + n * p.lse_strides[1] + t * p.lse_strides[2]] =
        sum > 0.0f ? max + std::log(sum) : kNegInf;
  }
}

// One finished row of a task: to the output (and logsumexp), or to its split's partials.
void FinishRow(const DotProductAttentionParams& p, const Dims& d, int64_t b, int64_t t, int64_t n,
               const float* row_acc, float row_max, float row_sum, int64_t split, SplitPartials* partials) {
  if (partials == nullptr) {
    StoreOutputRow(p, b, t, n, row_acc, row_sum, row_max);
    return;
  }
  const int64_t row = partials->Row(d, split, b, n, t);
  std::memcpy(partials->out.data() + row * d.value_dim, row_acc, d.value_dim * sizeof(float));
  partials->max[row] = row_max;
  partials->sum[row] = row_sum;
}

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

// The online softmax step of one tile, before the exponentiation: the new
// running max of each column, the factor alpha that rescales what was accumulated (the running
// sums rescaled here), and `sub`, what the tile's logits are shifted by before exp.
void UpdateRunningMax(const Kernels& k, const float* st, int64_t keys, int64_t ld, int64_t cols, float* max,
                      float* sum, float* alpha, float* sub, float* tile_max) {
  std::fill(tile_max, tile_max + cols, kNegInf);
  k.softmax->column_max(st, keys, ld, cols, tile_max);
  for (int64_t r = 0; r < cols; ++r) {
    const float new_max = std::max(max[r], tile_max[r]);
    alpha[r] = 1.0f;
    if (new_max != kNegInf && max[r] != kNegInf && new_max != max[r]) alpha[r] = std::exp(max[r] - new_max);
    sub[r] = new_max == kNegInf ? 0.0f : new_max;
    max[r] = new_max;
    sum[r] *= alpha[r];
  }
}

// A row-path task (UseRowDots): keys [kv_begin, kv_end) of one batch for every kv head. Its
// rows are the task's positions times all N query heads, r = position · N + n (TaskRows over kv
// head 0 with group N), so the logits' epilogue, masks and online softmax run once per tile for
// every head, vectorized across N columns with no padding between heads; the two products run
// per (kv head, position) on that head's `group` adjacent columns, K and V rows streamed in
// place in runs of kRowRunKeys keys across the heads.
void ForwardRowTask(const DotProductAttentionParams& p, const Dims& d, const Kernels& k,
                    const DotProductAttentionConfig& config, const TaskRows& task, int64_t kv_begin, int64_t kv_end,
                    int64_t split, SplitPartials* partials, ForwardScratch& s) {
  TaskRows rows = task;
  rows.kv_head = 0;
  rows.group = d.q_heads;
  const int64_t count = rows.count(), cols = RoundUp(count, 16), block = config.block_kv;
  const int64_t head_dim = d.head_dim, value_dim = d.value_dim;
  // bf16 q, k and v with head dims of whole 32-element steps take the tier's bf16 row products
  // where it has them (avx512bf16), with q's rows as they are and the scale applied to st.
  const bool bf16_rows = k.softmax->key_dots_bf16 != nullptr && p.q.dtype == DType::kBFloat16 &&
                         p.k.dtype == DType::kBFloat16 && p.v.dtype == DType::kBFloat16 && head_dim % 32 == 0 &&
                         value_dim % 32 == 0;
  float* q = nullptr;  // row r: scale · q[t(r), n(r)]
  uint16_t* q_bf16 = nullptr;  // row r: q[t(r), n(r)]
  if (bf16_rows) {
    q_bf16 = Scratch(s.q_bf16_rows, count * head_dim);
    GatherRowsBf16(p.q, rows, q_bf16, head_dim);
  } else {
    q = Scratch(s.q_rows, count * head_dim);
    GatherRows(*k.softmax, p.q, rows, head_dim, p.scale, q, head_dim);
  }
  float* st = Scratch(s.st, block * cols);
  float* acc = Scratch(s.acc, count * value_dim);
  float* max = Scratch(s.max, cols);
  float* sum = Scratch(s.sum, cols);
  float* sub = Scratch(s.sub, cols);
  float* alpha = Scratch(s.alpha, cols);
  float* tile_max = Scratch(s.tile_max, cols);
  // key_dots writes the real columns only; the softmax reads all of them, so the padding
  // columns start finite (and stay so: exp of finite values).
  std::fill(st, st + block * cols, 0.0f);
  std::fill(acc, acc + count * value_dim, 0.0f);
  std::fill(max, max + cols, kNegInf);
  std::fill(sum, sum + cols, 0.0f);
  ComputeRowMasks(p.masks, rows, d.kv_len, &s.row_masks);
  ForEachVisibleTile(p.masks, s.row_masks, rows.b, count, kv_begin, kv_end, block,
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
        k.softmax->key_dots_bf16(static_cast<const uint16_t*>(key), p.k.strides[1], n, head_dim,
                                 q_bf16 + r0 * head_dim, head_dim, d.group, p.scale, st + j0 * cols + r0, cols,
                                 static_cast<const uint16_t*>(next));
      } else {
        k.softmax->key_dots(p.k.dtype, key, p.k.strides[1], n, head_dim, q + r0 * head_dim, head_dim, d.group,
                            st + j0 * cols + r0, cols, next);
      }
    });
    FinishLogits(p, k, rows, s.row_masks, s0, keys, visibility, st, cols, nullptr);
    UpdateRunningMax(k, st, keys, cols, cols, max, sum, alpha, sub, tile_max);
    k.softmax->exp_columns(st, keys, cols, cols, sub, sum);
    k.softmax->scale_rows(acc, value_dim, count, value_dim, alpha);
    for_runs(p.v, p.k, s0 + block, kv_end, [&](int64_t h, int64_t r0, int64_t j0, int64_t n, const void* next) {
      const void* value = p.v.At(rows.b, s0 + j0, h, 0);
      if (bf16_rows) {
        k.softmax->accumulate_values_bf16(st + j0 * cols + r0, cols, n, d.group, static_cast<const uint16_t*>(value),
                                          p.v.strides[1], value_dim, acc + r0 * value_dim, value_dim,
                                          static_cast<const uint16_t*>(next));
      } else {
        k.softmax->accumulate_values(p.v.dtype, st + j0 * cols + r0, cols, n, d.group, value, p.v.strides[1],
                                     value_dim, acc + r0 * value_dim, value_dim, next);
      }
    });
  });
  for (int64_t r = 0; r < count; ++r) {
    FinishRow(p, d, rows.b, rows.t(r), rows.n(r), acc + r * value_dim, max[r], sum[r], split, partials);
  }
}

// A GEMM task: query block `rows` of one kv head against keys [kv_begin, kv_end), in tiles of
// block_kv keys, two ways:
//  - the fp32 micro-kernels (acc[row][e], P read in place as A);
//  - `bf16` (the tier's bf16 product engine on per-call K/Vᵀ copies): st = K·Qᵀ with Q in VNNI
//    panels (unscaled, so exact, the scale applied to st), and the accumulator kept transposed,
//    accᵀ[e][row] += Vᵀ·Pᵀ, so P needs no transpose, only its key pairs rounded to bf16 (as
//    flash attention does on GPUs).
void ForwardTask(const DotProductAttentionParams& p, const Dims& d, const Kernels& k,
                 const DotProductAttentionConfig& config, const TaskRows& rows, int64_t kv_begin, int64_t kv_end,
                 int64_t split, SplitPartials* partials, const KvTiles& k_tiles, const KvTiles& v_tiles,
                 const Bf16Operand* bf16_k, const Bf16Operand* bf16_vt, ForwardScratch& s) {
  const bool bf16 = bf16_k != nullptr;
  const GemmKernels& gemm = *k.gemm;
  const int64_t mr = gemm.mr, nr = gemm.nr;
  const int64_t count = rows.count(), kv_head = rows.kv_head;
  const int64_t cols = RoundUp(count, nr);  // st columns (query rows)
  const int64_t row_panels = CeilDiv(count, mr); // of P and the accumulator
  const int64_t ld_acc = bf16 ? cols : RoundUp(d.value_dim, nr);
  const int64_t acc_floats = bf16 ? d.value_dim * cols : row_panels * mr * ld_acc;
  const int64_t block = config.block_kv;
  const int64_t q_floats = cols * d.head_dim;  // Q as fp32 panels, or (bf16) bf16 VNNI panels

  float* q_panels = bf16 ? nullptr : Scratch(s.q_panels, q_floats);
  uint16_t* q_vnni = bf16 ? Scratch(s.q_vnni, q_floats) : nullptr;
  float* k_panels = Scratch(s.k_panels, k_tiles.tile_floats());
  const int64_t st_rows = std::max(RoundUp(block, mr), RoundUp(block, kBf16TileDepth));
  // P·V reads st in place as A: one key's rows per depth step, ld_st apart.
  const int64_t ld_st = SetSpreadingLd(cols);
  float* st = InPlaceTileScratch(s.st, st_rows, ld_st);
  float* v_panels = Scratch(s.v_panels, v_tiles.tile_floats());
  uint16_t* p_vnni = bf16 ? Scratch(s.p_vnni, st_rows * cols) : nullptr;
  float* acc = Scratch(s.acc, acc_floats);
  float* max = Scratch(s.max, cols);
  float* sum = Scratch(s.sum, cols);
  float* sub = Scratch(s.sub, cols);
  float* alpha = Scratch(s.alpha, cols);
  float* tile_max = Scratch(s.tile_max, cols);
  std::fill(acc, acc + acc_floats, 0.0f);
  std::fill(max, max + cols, kNegInf);
  std::fill(sum, sum + cols, 0.0f);
  std::unique_ptr<Bf16ProductScope> scope;
  if (bf16) {
    scope.reset(new Bf16ProductScope(k.bf16));
    PackRowsVnni(p.q, rows, cols, q_vnni);
  } else {
    float* q_rows = Scratch(s.q_rows, count * d.head_dim);
    GatherRows(*k.softmax, p.q, rows, d.head_dim, p.scale, q_rows, d.head_dim);
    k.softmax->transpose_panels(q_rows, d.head_dim, count, d.head_dim, nr, q_panels);
  }
  ComputeRowMasks(p.masks, rows, d.kv_len, &s.row_masks);
  ForEachVisibleTile(p.masks, s.row_masks, rows.b, count, kv_begin, kv_end, block,
                     [&](int64_t s0, TileVisibility visibility, int64_t keys) {
    // st = K_tile · (scale·Q)ᵀ, then the logits' epilogue and masks.
    if (bf16) {
      k.bf16.gemm(RoundUp(keys, kBf16TileRows), cols, d.head_dim, bf16_k->At(rows.b, kv_head, s0), bf16_k->ld(),
                  q_vnni, st, ld_st, false, p.scale);
    } else {
      TileGemm(gemm, d.head_dim, k_tiles.Tile(rows.b, kv_head, s0, keys, k_panels), CeilDiv(keys, mr),
               PackedB(q_panels, d.head_dim, nr), cols / nr, st, ld_st, false);
    }
    FinishLogits(p, k, rows, s.row_masks, s0, keys, visibility, st, ld_st, nullptr);
    UpdateRunningMax(k, st, keys, ld_st, cols, max, sum, alpha, sub, tile_max);
    if (bf16) {
      // accᵀ = accᵀ ∘ alpha + Vᵀ_tile · Pᵀ, with P = exp(st - sub) computed while its key pairs
      // are packed into VNNI panels (st itself is never written back).
      k.softmax->scale_columns(acc, ld_acc, d.value_dim, cols, alpha);
      const int64_t depth = RoundUp(keys, kBf16TileDepth);
      ExpPackVnni(st, ld_st, keys, depth, cols, sub, sum, p_vnni);
      k.bf16.gemm(d.value_dim, cols, depth, bf16_vt->At(rows.b, kv_head, s0), bf16_vt->ld(), p_vnni, acc, ld_acc,
                  true, 1.0f);
    } else {
      // acc = acc ∘ alpha + P · V_tile, with P = stᵀ read in place: at each key, a panel's mr
      // rows are adjacent.
      k.softmax->exp_columns(st, keys, ld_st, cols, sub, sum);
      k.softmax->scale_rows(acc, ld_acc, count, d.value_dim, alpha);
      TileGemm(gemm, keys, InPlaceA(st, ld_st, mr), row_panels, v_tiles.Tile(rows.b, kv_head, s0, keys, v_panels),
               ld_acc / nr, acc, ld_acc, true);
    }
  });
  // The bf16 accumulator is transposed: back to rows (one register transpose).
  const float* out = acc;
  int64_t ld_out = ld_acc;
  if (bf16) {
    float* out_rows = Scratch(s.out_rows, count * d.value_dim);
    k.softmax->transpose_panels(acc, ld_acc, d.value_dim, count, d.value_dim, out_rows);
    out = out_rows;
    ld_out = d.value_dim;
  }
  for (int64_t r = 0; r < count; ++r) {
    FinishRow(p, d, rows.b, rows.t(r), rows.n(r), out + r * ld_out, max[r], sum[r], split, partials);
  }
}

// Combines the splits of one output row in split order: out = sum_c e^(m_c - m) o_c / l.
void MergeSplits(const DotProductAttentionParams& p, const Dims& d, const SplitPartials& partials, int64_t splits,
                 int64_t b, int64_t n, int64_t t, std::vector<float>& merged) {
  merged.assign(d.value_dim, 0.0f);
  float max = kNegInf;
  for (int64_t c = 0; c < splits; ++c) max = std::max(max, partials.max[partials.Row(d, c, b, n, t)]);
  float sum = 0.0f;
  if (max != kNegInf) {
    for (int64_t c = 0; c < splits; ++c) {
      const int64_t row = partials.Row(d, c, b, n, t);
      if (partials.max[row] == kNegInf) continue;
      const float weight = std::exp(partials.max[row] - max);
      sum += weight * partials.sum[row];
      const float* o = partials.out.data() + row * d.value_dim;
      for (int64_t e = 0; e < d.value_dim; ++e) merged[e] += weight * o[e];
    }
  }
  StoreOutputRow(p, b, t, n, merged.data(), sum, max);
}

void ZeroOutputs(const DotProductAttentionParams& p, const Dims& d) {
  std::vector<float> zeros(d.value_dim, 0.0f);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t t = 0; t < d.q_len; ++t)
      for (int64_t n = 0; n < d.q_heads; ++n) StoreOutputRow(p, b, t, n, zeros.data(), 0.0f, kNegInf);
}

// ---- backward ------------------------------------------------------------------------------

struct BackwardScratch {
  std::vector<float> q_panels, q_rows, do_panels, do_rows, q_bpanels, do_bpanels, k_panels, k_rows, v_panels, st, dpt,
      tanh, a_panels, dq_acc, lse_sub, delta;
  std::vector<uint16_t> q_vnni, do_vnni, q_row_vnni, do_row_vnni, tile_rows, tile_vnni;  // bf16 engine operands
  RowMasks row_masks;
};

// The bf16 engine's operands of the backward: K as rows (K·Qᵀ) and transposed (Kᵀ·dS), V as rows (V·dOᵀ).
struct Bf16BackwardOperands {
  Bf16Operand k_rows, k_t, v_rows;
};

// One chunk of query blocks of one (batch, kv head): dq of its rows is written directly, dk/dv
// partial sums go to dk_acc/dv_acc ([S + 16 rows] x ld, this chunk's own).
//
// With `bf16` the five products run on the bf16 product engine: st = K·Qᵀ and dPᵀ = V·dOᵀ as in
// the forward (Q and dO in VNNI panels), dV += P·dO and dK += dS·Q with P and dS rounded to bf16
// rows and dO and Q (unscaled: dK is scaled when stored) as VNNI panels over the block's rows,
// and dQᵀ += Kᵀ·dS with dS's key pairs in VNNI panels, dQ kept transposed.
void BackwardTask(const DotProductAttentionGradParams& g, const Dims& d, const Kernels& k,
                  const DotProductAttentionConfig& config, int64_t b, int64_t kv_head, int64_t qb_begin,
                  int64_t qb_end, float* dk_acc, int64_t ld_dk, float* dv_acc, int64_t ld_dv,
                  const KvTiles& k_tiles, const KvTiles& v_tiles, const KvTiles& k_row_tiles,
                  const Bf16BackwardOperands* bf16_ops, BackwardScratch& s) {
  const DotProductAttentionParams& p = g.forward;
  const bool bf16 = bf16_ops != nullptr;
  const StridedView<4> out = p.out.AsConst();
  const GemmKernels& gemm = *k.gemm;
  const int64_t mr = gemm.mr, nr = gemm.nr;
  const int64_t block = config.block_kv;
  const int64_t max_rows = config.block_q * d.group;
  const int64_t max_cols = RoundUp(max_rows, std::max(nr, kBf16TileDepth));
  const int64_t ld_dq = RoundUp(d.head_dim, nr);
  const int64_t kv_rows = std::max(RoundUp(block, mr), RoundUp(block, kBf16TileDepth));

  float* q_panels = Scratch(s.q_panels, max_cols * d.head_dim);
  float* q_rows = Scratch(s.q_rows, max_rows * ld_dq);
  float* do_panels = Scratch(s.do_panels, max_cols * d.value_dim);
  float* do_rows = Scratch(s.do_rows, max_rows * ld_dv);
  float* q_bpanels = Scratch(s.q_bpanels, max_rows * ld_dq);
  float* do_bpanels = Scratch(s.do_bpanels, max_rows * ld_dv);
  float* k_panels = Scratch(s.k_panels, k_tiles.tile_floats());
  float* k_rows = Scratch(s.k_rows, k_row_tiles.tile_floats());
  float* v_panels = Scratch(s.v_panels, v_tiles.tile_floats());
  // P, dPᵀ and the soft cap's tanh as [key][row] tiles, SetSpreadingLd(cols) apart (dQ reads dS
  // in place as A).
  const int64_t max_ld_st = SetSpreadingLd(max_cols);
  float* st = Scratch(s.st, kv_rows * max_ld_st);
  float* dpt = InPlaceTileScratch(s.dpt, kv_rows, max_ld_st);
  float* tanh_values = p.logits_soft_cap > 0.0f ? Scratch(s.tanh, kv_rows * max_ld_st) : nullptr;
  // Packed P or dS, the O rows before the first tile, and for bf16 dQ as rows after the last.
  float* a_panels = Scratch(s.a_panels, std::max({kv_rows * max_cols, max_rows * ld_dv, max_rows * ld_dq}));
  float* dq_acc = Scratch(s.dq_acc, std::max(RoundUp(max_rows, mr) * ld_dq, d.head_dim * max_cols));
  float* lse_sub = Scratch(s.lse_sub, max_cols);
  float* delta = Scratch(s.delta, max_cols);
  // bf16: the block's rows as VNNI panels over H or Hv (B of K·Qᵀ, V·dOᵀ) and over the rows
  // (B of dS·Q, P·dO), and one bf16 tile (P, then dS) as rows and as VNNI key pairs.
  uint16_t *q_vnni = nullptr, *do_vnni = nullptr, *q_row_vnni = nullptr, *do_row_vnni = nullptr;
  uint16_t *tile_rows = nullptr, *tile_vnni = nullptr;
  std::unique_ptr<Bf16ProductScope> scope;
  if (bf16) {
    q_vnni = Scratch(s.q_vnni, max_cols * d.head_dim);
    do_vnni = Scratch(s.do_vnni, max_cols * d.value_dim);
    q_row_vnni = Scratch(s.q_row_vnni, max_cols * d.head_dim);
    do_row_vnni = Scratch(s.do_row_vnni, max_cols * d.value_dim);
    tile_rows = Scratch(s.tile_rows, kv_rows * max_cols);
    tile_vnni = Scratch(s.tile_vnni, kv_rows * max_cols);
    scope.reset(new Bf16ProductScope(k.bf16));
  }

  for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
    TaskRows rows;
    rows.b = b;
    rows.kv_head = kv_head;
    rows.group = d.group;
    rows.t0 = qb * config.block_q;
    rows.positions = std::min(config.block_q, d.q_len - rows.t0);
    const int64_t count = rows.count();
    const int64_t cols = RoundUp(count, bf16 ? std::max(nr, kBf16TileDepth) : nr);
    const int64_t ld_st = SetSpreadingLd(cols);
    const int64_t row_panels = CeilDiv(count, mr);
    ComputeRowMasks(p.masks, rows, d.kv_len, &s.row_masks);
    const int64_t dq_floats = bf16 ? d.head_dim * cols : row_panels * mr * ld_dq;
    std::fill(dq_acc, dq_acc + dq_floats, 0.0f);
    // A block no row of which sees a key (past its length) has dq = 0 and needs no operands.
    const bool any_visible = s.row_masks.max_end > 0;
    if (any_visible) {
      // The block's operands: Q (scaled, or for bf16 exact) and dO as rows, and transposed.
      GatherRows(*k.softmax, p.q, rows, d.head_dim, bf16 ? 1.0f : p.scale, q_rows, ld_dq);
      GatherRows(*k.softmax, g.dout, rows, d.value_dim, 1.0f, do_rows, ld_dv);
      if (bf16) {
        PackRowsVnni(p.q, rows, cols, q_vnni);
        PackRowsVnni(g.dout, rows, cols, do_vnni);
        PackVnniFromRows(q_rows, ld_dq, count, cols, d.head_dim, q_row_vnni);
        PackVnniFromRows(do_rows, ld_dv, count, cols, d.value_dim, do_row_vnni);
      } else {
        k.softmax->transpose_panels(q_rows, ld_dq, count, d.head_dim, nr, q_panels);
        k.softmax->transpose_panels(do_rows, ld_dv, count, d.value_dim, nr, do_panels);
        // Q and dO as the B panels of dK += dS·Q and dV += P·dO, over the block's rows: read in
        // place instead (rows 512 bytes apart), those two products ran 8-15% slower than the
        // other three.
        gemm.pack_b({q_rows, DType::kFloat32, count, d.head_dim, ld_dq, 1}, 0, count, 0, d.head_dim, q_bpanels);
        gemm.pack_b({do_rows, DType::kFloat32, count, d.value_dim, ld_dv, 1}, 0, count, 0, d.value_dim, do_bpanels);
      }
      // Per row: lse (0 for rows that see nothing: their logits are all -inf, so P = 0) and
      // delta = rowsum(dO ∘ O) - dlse.
      std::fill(lse_sub, lse_sub + cols, 0.0f);
      std::fill(delta, delta + cols, 0.0f);
      float* out_rows = a_panels;  // free until the first tile
      GatherRows(*k.softmax, out, rows, d.value_dim, 1.0f, out_rows, ld_dv);
      for (int64_t r = 0; r < count; ++r) {
        const int64_t t = rows.t(r), n = rows.n(r);
        const float lse = static_cast<const float*>(p.lse)[b * p.lse_strides[0] + n * p.lse_strides[1] + t * p.lse_strides[2]];
        lse_sub[r] = lse == kNegInf ? 0.0f : lse;
        float dot = 0.0f;
        for (int64_t e = 0; e < d.value_dim; ++e) dot += do_rows[r * ld_dv + e] * out_rows[r * ld_dv + e];
        if (g.dlse != nullptr) {
          dot -= static_cast<const float*>(g.dlse)[b * g.dlse_strides[0] + n * g.dlse_strides[1] + t * g.dlse_strides[2]];
        }
        delta[r] = dot;
      }
    }
    if (any_visible) {
      ForEachVisibleTile(p.masks, s.row_masks, b, count, 0, d.kv_len, block,
                         [&](int64_t s0, TileVisibility visibility, int64_t keys) {
        const int64_t key_panels = CeilDiv(keys, mr);
        const int64_t key_tiles = RoundUp(keys, kBf16TileRows);  // bf16: rows of the key-major products
        // P = exp(logits - lse), recomputed.
        if (bf16) {
          k.bf16.gemm(key_tiles, cols, d.head_dim, bf16_ops->k_rows.At(b, kv_head, s0), bf16_ops->k_rows.ld(), q_vnni,
                      st, ld_st, false, p.scale);
        } else {
          TileGemm(gemm, d.head_dim, k_tiles.Tile(b, kv_head, s0, keys, k_panels), key_panels,
                   PackedB(q_panels, d.head_dim, nr), cols / nr, st, ld_st, false);
        }
        FinishLogits(p, k, rows, s.row_masks, s0, keys, visibility, st, ld_st, tanh_values);
        k.softmax->exp_columns(st, keys, ld_st, cols, lse_sub, nullptr);
        // dV_tile += P · dO; dPᵀ = V_tile · dOᵀ.
        if (bf16) {
          // P's rows past `keys` are zero: they must add nothing to the next tile's dV rows.
          ConvertRowsBf16(st, ld_st, keys, key_tiles, cols, tile_rows, cols);
          k.bf16.gemm(key_tiles, d.value_dim, cols, tile_rows, cols, do_row_vnni, dv_acc + s0 * ld_dv, ld_dv, true,
                      1.0f);
          k.bf16.gemm(key_tiles, cols, d.value_dim, bf16_ops->v_rows.At(b, kv_head, s0), bf16_ops->v_rows.ld(), do_vnni,
                      dpt, ld_st, false, 1.0f);
        } else {
          gemm.pack_a({st, DType::kFloat32, keys, count, ld_st, 1}, 0, keys, 0, count, a_panels);
          TileGemm(gemm, count, PackedA(a_panels, count, mr), key_panels, PackedB(do_bpanels, count, nr), ld_dv / nr,
                   dv_acc + s0 * ld_dv, ld_dv, true);
          TileGemm(gemm, d.value_dim, v_tiles.Tile(b, kv_head, s0, keys, v_panels), key_panels,
                   PackedB(do_panels, d.value_dim, nr), cols / nr, dpt, ld_st, false);
        }
        // dS = P ∘ (dP - delta), times the soft cap's derivative.
        k.softmax->softmax_grad_columns(st, dpt, keys, ld_st, cols, delta);
        if (tanh_values != nullptr) {
          for (int64_t j = 0; j < keys; ++j) {
            for (int64_t r = 0; r < cols; ++r) {
              dpt[j * ld_st + r] *= 1.0f - tanh_values[j * ld_st + r] * tanh_values[j * ld_st + r];
            }
          }
        }
        if (g.dbias != nullptr) {
          const int64_t dbias_b = g.dbias_sum_batches ? 0 : b;
          for (int64_t r = 0; r < count; ++r) {
            float* dst = static_cast<float*>(g.dbias) +
                         ((dbias_b * d.q_heads + rows.n(r)) * d.q_len + rows.t(r)) * d.kv_len + s0;
            for (int64_t j = 0; j < keys; ++j) dst[j] += dpt[j * ld_st + r];
          }
        }
        // dK_tile += dS · (scale·Q); dQ += dS · K_tile (scaled when stored).
        if (bf16) {
          ConvertRowsBf16(dpt, ld_st, keys, key_tiles, cols, tile_rows, cols);
          k.bf16.gemm(key_tiles, d.head_dim, cols, tile_rows, cols, q_row_vnni, dk_acc + s0 * ld_dk, ld_dk, true, 1.0f);
          const int64_t depth = RoundUp(keys, kBf16TileDepth);
          PackVnniFromRows(dpt, ld_st, keys, depth, cols, tile_vnni);
          k.bf16.gemm(d.head_dim, cols, depth, bf16_ops->k_t.At(b, kv_head, s0), bf16_ops->k_t.ld(), tile_vnni, dq_acc,
                      cols, true, 1.0f);
        } else {
          gemm.pack_a({dpt, DType::kFloat32, keys, count, ld_st, 1}, 0, keys, 0, count, a_panels);
          TileGemm(gemm, count, PackedA(a_panels, count, mr), key_panels, PackedB(q_bpanels, count, nr), ld_dk / nr,
                   dk_acc + s0 * ld_dk, ld_dk, true);
          TileGemm(gemm, keys, InPlaceA(dpt, ld_st, mr), row_panels, k_row_tiles.Tile(b, kv_head, s0, keys, k_rows),
                   ld_dq / nr, dq_acc, ld_dq, true);
        }
      });
    }
    const float* dq_rows = dq_acc;
    int64_t ld_rows = ld_dq;
    if (bf16) {  // dQᵀ back to rows
      k.softmax->transpose_panels(dq_acc, cols, d.head_dim, count, d.head_dim, a_panels);
      dq_rows = a_panels;
      ld_rows = d.head_dim;
    }
    for (int64_t r = 0; r < count; ++r) StoreRow(g.dq, b, rows.t(r), rows.n(r), dq_rows + r * ld_rows, d.head_dim, p.scale);
  }
}

}  // namespace

Status DotProductAttention(const DotProductAttentionParams& p, const DotProductAttentionConfig& config) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  Kernels k;
  status = GetKernels(&k);
  if (!status.ok()) return status;
  const Dims d = DimsOf(p);
  status = CheckTile(config, d.group);
  if (!status.ok()) return status;
  if (d.batch == 0 || d.q_len == 0 || d.q_heads == 0) return Status::Ok();
  if (p.q.dtype == DType::kFloat64) {
    DotProductAttentionReference(p);
    return Status::Ok();
  }
  if (d.kv_len == 0 || d.value_dim == 0) {
    ZeroOutputs(p, d);
    return Status::Ok();
  }
  const int64_t q_blocks = CeilDiv(d.q_len, config.block_q);
  const int64_t kv_blocks = CeilDiv(d.kv_len, config.block_kv);
  const int64_t splits = std::min(config.num_splits, kv_blocks);
  SplitPartials partials;
  if (splits > 1) {
    const int64_t rows = splits * d.batch * d.q_heads * d.q_len;
    partials.out.assign(rows * d.value_dim, 0.0f);
    partials.max.assign(rows, kNegInf);
    partials.sum.assign(rows, 0.0f);
  }
  // Several query blocks read each kv tile: pack K and V once.
  // (The bf16 engine's path copies them once as bf16 instead.)
  const bool row_dots = UseRowDots(p, q_blocks, std::min(config.block_q, d.q_len) * d.group);
  const bool use_bf16 = !row_dots && UseBf16Products(p, k);
  const KvTiles k_tiles(*k.gemm, p.k, config.block_kv, /*as_a=*/true, /*pack_all=*/q_blocks > 1 && !use_bf16);
  const KvTiles v_tiles(*k.gemm, p.v, config.block_kv, /*as_a=*/false, /*pack_all=*/q_blocks > 1 && !use_bf16);
  std::unique_ptr<Bf16Operand> bf16_k, bf16_vt;
  if (use_bf16) {
    bf16_k.reset(new Bf16Operand(p.k, Bf16Operand::kRows));
    bf16_vt.reset(new Bf16Operand(p.v, Bf16Operand::kTransposed));
  }
  // Tasks are pulled from a shared counter, latest query blocks first: under a causal mask they
  // are the longest, and starting them first balances the threads.
  const int64_t task_heads = row_dots ? d.kv_heads : 1;  // kv heads per task
  const int64_t head_groups = d.kv_heads / task_heads;
  const int64_t num_tasks = d.batch * head_groups * q_blocks * splits;
  std::atomic<int64_t> next{0};
  ParallelFor(0, num_tasks, 1, [&](int64_t, int64_t) {
    thread_local ForwardScratch scratch;
    for (int64_t task = next.fetch_add(1); task < num_tasks; task = next.fetch_add(1)) {
      const int64_t split = task % splits;
      const int64_t qb = q_blocks - 1 - (task / splits) % q_blocks;
      const int64_t kv_head = (task / splits / q_blocks) % head_groups * task_heads;
      TaskRows rows;
      rows.b = task / splits / q_blocks / head_groups;
      rows.kv_head = kv_head;
      rows.group = d.group;
      rows.t0 = qb * config.block_q;
      rows.positions = std::min(config.block_q, d.q_len - rows.t0);
      const int64_t kv_begin = (kv_blocks * split / splits) * config.block_kv;
      const int64_t kv_end = std::min(d.kv_len, (kv_blocks * (split + 1) / splits) * config.block_kv);
      SplitPartials* task_partials = splits > 1 ? &partials : nullptr;
      if (row_dots) {
        ForwardRowTask(p, d, k, config, rows, kv_begin, kv_end, split, task_partials, scratch);
      } else {
        ForwardTask(p, d, k, config, rows, kv_begin, kv_end, split, task_partials, k_tiles, v_tiles, bf16_k.get(),
                    bf16_vt.get(), scratch);
      }
    }
  });
  if (splits > 1) {
    const int64_t rows = d.batch * d.q_heads * d.q_len;
    ParallelFor(0, rows, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> merged;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t t = row % d.q_len, n = (row / d.q_len) % d.q_heads, b = row / d.q_len / d.q_heads;
        MergeSplits(p, d, partials, splits, b, n, t, merged);
      }
    });
  }
  return Status::Ok();
}

// The backward splits each (batch, kv head)'s query blocks into this many tasks.
int64_t BackwardSplits(int64_t q_len, const DotProductAttentionConfig& config) {
  const int64_t q_blocks = q_len > 0 ? CeilDiv(q_len, config.block_q) : 0;
  return std::max<int64_t>(1, std::min(config.num_splits, q_blocks));
}

int64_t DotProductAttentionBackwardTasksPerBatch(int64_t q_len, int64_t kv_heads,
                                                 const DotProductAttentionConfig& config) {
  return kv_heads * BackwardSplits(q_len, config);
}

Status DotProductAttentionBackward(const DotProductAttentionGradParams& g, const DotProductAttentionConfig& config) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  Kernels k;
  status = GetKernels(&k);
  if (!status.ok()) return status;
  const DotProductAttentionParams& p = g.forward;
  const Dims d = DimsOf(p);
  status = CheckTile(config, d.group);
  if (!status.ok()) return status;
  if (p.lse == nullptr && d.batch * d.q_heads * d.q_len > 0) return Status::Error("dot_product_attention backward: the forward's logsumexp is required");
  if (p.q.dtype == DType::kFloat64) {
    DotProductAttentionBackwardReference(g);
    return Status::Ok();
  }
  const int64_t mr = k.gemm->mr, nr = k.gemm->nr;
  const int64_t q_blocks = d.q_len > 0 ? CeilDiv(d.q_len, config.block_q) : 0;
  const int64_t splits = BackwardSplits(d.q_len, config);
  const int64_t ld_dk = RoundUp(d.head_dim, nr), ld_dv = RoundUp(d.value_dim, nr);
  // Per (split, batch, kv head): fp32 dk/dv partial sums over [S + 16) rows (tiles write whole
  // mr-row panels or 16-row bf16 tiles; the padding rows only ever receive zeros).
  const int64_t acc_rows = d.kv_len + std::max(mr, kBf16TileRows);
  const int64_t heads = d.batch * d.kv_heads;
  // Zeroed by the task that owns each slice, not by the allocator: the micro-kernels read their
  // accumulators before writing them, and a read of an untouched page maps the shared zero page,
  // so the write after it is a copy-on-write fault that flushes the other core's TLB (an IPI,
  // a VM exit under KVM: ~6% of fp32 forward+backward samples on Zen 4). Written first, each
  // page takes one plain fault.
  LargeBuffer<float> dk_acc(splits * heads * acc_rows * ld_dk, LargeBuffer<float>::kUninitialized);
  LargeBuffer<float> dv_acc(splits * heads * acc_rows * ld_dv, LargeBuffer<float>::kUninitialized);
  if (g.dbias != nullptr) {
    float* dbias = static_cast<float*>(g.dbias);
    std::fill(dbias, dbias + (g.dbias_sum_batches ? 1 : d.batch) * d.q_heads * d.q_len * d.kv_len, 0.0f);
  }
  // Several query blocks read each kv tile: pack K, V and K's rows once.
  const bool use_bf16 = UseBf16ProductsBackward(g, k) && d.kv_len > 0;
  const bool pack_all = q_blocks > 1 && d.kv_len > 0 && !use_bf16;
  std::unique_ptr<Bf16BackwardOperands> bf16_ops;
  if (use_bf16) {
    bf16_ops.reset(new Bf16BackwardOperands{Bf16Operand(p.k, Bf16Operand::kRows),
                                            Bf16Operand(p.k, Bf16Operand::kTransposed),
                                            Bf16Operand(p.v, Bf16Operand::kRows)});
  }
  const KvTiles k_tiles(*k.gemm, p.k, config.block_kv, /*as_a=*/true, pack_all);
  const KvTiles v_tiles(*k.gemm, p.v, config.block_kv, /*as_a=*/true, pack_all);
  const KvTiles k_row_tiles(*k.gemm, p.k, config.block_kv, /*as_a=*/false, pack_all);
  // Tasks (split, batch, kv head) in one pool; when dbias sums the batches, one pool per batch,
  // in batch order (each element of dbias then has one writer at a time, and its sum a fixed
  // order).
  const int64_t pools = g.dbias != nullptr && g.dbias_sum_batches ? d.batch : 1;
  const int64_t heads_per_pool = heads / std::max<int64_t>(pools, 1);
  for (int64_t pool = 0; pool < pools; ++pool) {
    const int64_t num_tasks = heads_per_pool * splits;
    std::atomic<int64_t> next{0};
    ParallelFor(0, num_tasks, 1, [&](int64_t, int64_t) {
      thread_local BackwardScratch scratch;
      for (int64_t task = next.fetch_add(1); task < num_tasks; task = next.fetch_add(1)) {
        const int64_t split = task % splits, head = pool * heads_per_pool + task / splits;
        const int64_t qb_begin = q_blocks * split / splits, qb_end = q_blocks * (split + 1) / splits;
        float* dk = dk_acc.data() + (split * heads + head) * acc_rows * ld_dk;
        float* dv = dv_acc.data() + (split * heads + head) * acc_rows * ld_dv;
        std::fill(dk, dk + acc_rows * ld_dk, 0.0f);
        std::fill(dv, dv + acc_rows * ld_dv, 0.0f);
        BackwardTask(g, d, k, config, head / d.kv_heads, head % d.kv_heads, qb_begin, qb_end, dk, ld_dk, dv, ld_dv,
                     k_tiles, v_tiles, k_row_tiles, bf16_ops.get(), scratch);
      }
    });
  }
  // dk, dv = the splits' partial sums, added in split order.
  ParallelFor(0, heads * d.kv_len, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> total(std::max(ld_dk, ld_dv));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t head = row / d.kv_len, s = row % d.kv_len;
      const int64_t b = head / d.kv_heads, kv_head = head % d.kv_heads;
      auto sum_splits = [&](const LargeBuffer<float>& acc, int64_t ld, int64_t width) {
        std::copy_n(acc.data() + (head * acc_rows + s) * ld, width, total.data());
        for (int64_t c = 1; c < splits; ++c) {
          const float* part = acc.data() + ((c * heads + head) * acc_rows + s) * ld;
          for (int64_t e = 0; e < width; ++e) total[e] += part[e];
        }
      };
      sum_splits(dk_acc, ld_dk, d.head_dim);
      StoreRow(g.dk, b, s, kv_head, total.data(), d.head_dim, use_bf16 ? p.scale : 1.0f);  // bf16: dS·Q unscaled
      sum_splits(dv_acc, ld_dv, d.value_dim);
      StoreRow(g.dv, b, s, kv_head, total.data(), d.value_dim, 1.0f);
    }
  });
  return Status::Ok();
}

}  // namespace tokamax
