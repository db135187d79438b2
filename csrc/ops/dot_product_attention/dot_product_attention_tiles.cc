// What every attention task does per kv tile, forward and backward alike: its rows gathered as
// operands, its masks (which tiles it sees, which keys of a partial tile), the logits' epilogue
// (bias, soft cap, masks).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>

#include "csrc/core/runtime/isa.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/ops/dot_product_attention/dot_product_attention_internal.h"

namespace tokamax {
namespace attention {

Status BeginCall(const DotProductAttentionParams& p, const DotProductAttentionConfig& config, Kernels* kernels) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  status = GetKernels(kernels);
  if (!status.ok()) return status;
  constexpr int64_t kMaxTileFloats = int64_t{1} << 24;  // 64 MiB of fp32 logits
  const int64_t group = DimsOf(p).group;
  if (config.block_q * group * config.block_kv > kMaxTileFloats) {
    return Status::Error("dot_product_attention config: block_q * (query heads per kv head) * block_kv must be "
                         "at most 2^24, got " + std::to_string(config.block_q) + " * " + std::to_string(group) +
                         " * " + std::to_string(config.block_kv));
  }
  return Status::Ok();
}

void StoreRow(const GemmKernels& gemm, const MutableStridedView<4>& view, int64_t i0, int64_t i1, int64_t i2,
              float* values, int64_t count, float scale) {
  GemmEpilogue epilogue;
  epilogue.scale = scale;
  const MutableMatrix row{view.At(i0, i1, i2, 0), view.dtype, 1, count, 0, view.strides[3]};
  gemm.store_c(values, count, 1, count, row, 0, 0, epilogue);
}

float* InPlaceTileScratch(TaskScratch& s, TaskScratchSlot slot, int64_t rows, int64_t ld) {
  float* tile = Scratch<float>(s, slot, (rows + 1) * ld);
  std::fill(tile + rows * ld, tile + (rows + 1) * ld, 0.0f);
  return tile;
}

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

void GatherRowsBf16(const StridedView<4>& x, const TaskRows& rows, uint16_t* dst, int64_t ld) {
  for (int64_t r = 0; r < rows.count(); ++r) {
    const uint16_t* src = static_cast<const uint16_t*>(x.At(rows.b, rows.t(r), rows.n(r), 0));
    CopyBf16(src, 0, x.strides[3], 1, x.sizes[3], /*transpose=*/false, dst + r * ld, ld);
  }
}

void PackRowsVnni(const StridedView<4>& x, const TaskRows& rows, int64_t cols, uint16_t* dst, TaskScratch& s) {
  const int64_t depth = x.sizes[3];
  uint16_t* block = Scratch<uint16_t>(s, kRowsVnniBlock, kBf16TileRows * depth);
  for (int64_t r0 = 0; r0 < cols; r0 += kBf16TileRows) {
    const uint16_t* vectors[kBf16TileRows] = {};
    for (int64_t j = 0; j < kBf16TileRows && r0 + j < rows.count(); ++j) {
      const int64_t r = r0 + j;
      vectors[j] = static_cast<const uint16_t*>(x.At(rows.b, rows.t(r), rows.n(r), 0));
    }
    PackVnniFromBf16Vectors(vectors, x.strides[3], depth, depth, dst + r0 * depth, block);
  }
}

void ComputeRowMasks(const AttentionMasks& m, const TaskRows& rows, int64_t kv_len, RowMasks* out) {
  out->ranges.resize(rows.count());
  out->max_end = 0;
  for (int64_t r = 0; r < rows.count(); ++r) {
    const attention::KeyRange range = attention::VisibleKeys(m, rows.b, rows.n(r), rows.t(r), kv_len);
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

namespace {

// A bool mask's bytes read 8 at a time where the keys are contiguous: the word at key s, and
// whether some byte of it is zero (a hidden key).
uint64_t MaskWord(const uint8_t* row, int64_t s) {
  uint64_t word;
  std::memcpy(&word, row + s, sizeof(word));
  return word;
}
bool HasZeroByte(uint64_t word) {
  constexpr uint64_t kLows = 0x0101010101010101ull, kHighs = 0x8080808080808080ull;
  return ((word - kLows) & ~word & kHighs) != 0;
}

// Whether the bool mask shows any, and every, key of [begin, end) to row `row` (its bytes from
// `row` on, `stride` apart).
void ScanMaskRun(const uint8_t* row, int64_t stride, int64_t begin, int64_t end, bool* any, bool* all) {
  int64_t s = begin;
  for (; stride == 1 && s + 8 <= end; s += 8) {
    const uint64_t word = MaskWord(row, s);
    if (word != 0) *any = true;
    if (HasZeroByte(word)) *all = false;
    if (*any && !*all) return;
  }
  for (; s < end; ++s) {
    if (row[s * stride] != 0) *any = true;
    else *all = false;
  }
}

// The one run of visible keys [*begin, *end) of a mask row of `keys` bytes `stride` apart ({0, 0}
// when it shows none); false when its visible keys are not one run.
bool MaskRowRun(const uint8_t* row, int64_t stride, int64_t keys, int64_t* begin, int64_t* end) {
  const bool words = stride == 1;
  int64_t s = 0;
  while (words && s + 8 <= keys && MaskWord(row, s) == 0) s += 8;
  while (s < keys && row[s * stride] == 0) ++s;
  if (s == keys) {
    *begin = *end = 0;
    return true;
  }
  *begin = s;
  while (words && s + 8 <= keys && !HasZeroByte(MaskWord(row, s))) s += 8;
  while (s < keys && row[s * stride] != 0) ++s;
  *end = s;
  while (words && s + 8 <= keys && MaskWord(row, s) == 0) s += 8;
  while (s < keys && row[s * stride] == 0) ++s;
  return s == keys;
}

}  // namespace

AttentionMasks FoldMaskRuns(const AttentionMasks& m, const Dims& d, std::vector<int64_t>* runs) {
  if (m.mask == nullptr || m.mask_runs != nullptr) return m;
  const int64_t* st = m.mask_strides;
  // One run per distinct mask row: a dim the mask is broadcast over (stride 0) counts once.
  const int64_t batches = st[0] != 0 ? d.batch : 1, heads = st[1] != 0 ? d.q_heads : 1;
  const int64_t positions = st[2] != 0 ? d.q_len : 1, rows = batches * heads * positions;
  if (rows == 0 || d.kv_len == 0) return m;
  runs->resize(static_cast<size_t>(2 * rows));
  int64_t* out = runs->data();
  std::atomic<bool> runs_only{true};
  ParallelFor(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end && runs_only.load(std::memory_order_relaxed); ++i) {
      const int64_t t = i % positions, n = i / positions % heads, b = i / positions / heads;
      if (!MaskRowRun(m.mask + b * st[0] + n * st[1] + t * st[2], st[3], d.kv_len, out + 2 * i, out + 2 * i + 1)) {
        runs_only.store(false, std::memory_order_relaxed);
      }
    }
  });
  if (!runs_only.load()) return m;
  AttentionMasks folded = m;
  folded.mask = nullptr;
  for (int64_t& stride : folded.mask_strides) stride = 0;
  folded.mask_runs = out;
  folded.mask_run_strides[0] = st[0] != 0 ? heads * positions : 0;
  folded.mask_run_strides[1] = st[1] != 0 ? positions : 0;
  folded.mask_run_strides[2] = st[2] != 0 ? 1 : 0;
  return folded;
}

TileVisibility ClassifyTile(const AttentionMasks& m, const RowMasks& rm, const TaskRows& rows, int64_t s0,
                            int64_t s1) {
  const int64_t b = rows.b;
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
  if (m.mask != nullptr) {
    // A tile the bool mask hides from every row is skipped like one outside the ranges (a
    // causal mask passed as a tensor: half the tiles); one it shows whole needs no mask.
    // Rows that differ only by head share a mask row when the mask is broadcast over heads.
    // Whether it shows every key matters only where nothing else needs a mask: else the first
    // visible key ends the scan.
    const int64_t step = m.mask_strides[1] == 0 ? rows.group : 1;
    const bool may_be_full = all && m.q_segment_ids == nullptr;
    bool mask_any = false, mask_all = true;
    for (int64_t r = 0; r < rows.count() && !(mask_any && (!mask_all || !may_be_full)); r += step) {
      const int64_t begin = std::max(rm.ranges[r].begin, s0), end = std::min(rm.ranges[r].end, s1);
      if (begin >= end) continue;
      ScanMaskRun(attention::MaskRow(m, b, rows.n(r), rows.t(r)), m.mask_strides[3], begin, end, &mask_any,
                  &mask_all);
    }
    if (!mask_any) return TileVisibility::kNone;
    if (may_be_full && mask_all) return TileVisibility::kFull;
  }
  return all && !attention::HasElementMasks(m) ? TileVisibility::kFull : TileVisibility::kPartial;
}

Status GetKernels(Kernels* kernels) {
  Isa isa;
  const Status status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  kernels->gemm = &GetGemmKernels(isa);
  kernels->softmax = &GetSoftmaxKernels(isa);
  kernels->rows = &GetRowProducts(isa);
  kernels->bf16 = GetBf16Products(isa);
  return Status::Ok();
}

void FinishLogits(const DotProductAttentionParams& p, const Kernels& k, const TaskRows& rows, const RowMasks& rm,
                  int64_t s0, int64_t keys, TileVisibility visibility, float* st, int64_t ld, float* cap_slope_out) {
  const int64_t count = rows.count();
  if (p.bias.data != nullptr) {
    // Row by row along the keys: the dtype dispatched and each row's address taken once.
    DispatchDType(p.bias.dtype, [&](auto tag) {
      using T = decltype(tag);
      const int64_t key_stride = p.bias.strides[3];
      for (int64_t r = 0; r < count; ++r) {
        const T* row = static_cast<const T*>(p.bias.data) + p.bias.Offset(rows.b, rows.n(r), rows.t(r), s0);
        for (int64_t j = 0; j < keys; ++j) st[j * ld + r] += LoadAsFloat(row + j * key_stride);
      }
      return 0;
    });
  }
  if (p.logits_soft_cap > 0.0f) {
    k.softmax->soft_cap(st, keys, ld, count, p.logits_soft_cap, cap_slope_out, ld);
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

}  // namespace attention
}  // namespace tokamax
