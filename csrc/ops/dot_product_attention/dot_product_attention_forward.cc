// The dot_product_attention forward: flash attention (online softmax over kv tiles), as GEMM
// tasks over query blocks (ForwardTask) or the decode row path (dot_product_attention_decode.cc),
// the kv sequence optionally split across tasks and merged after.
#include <atomic>
#include <cmath>
#include <limits>
#include <cstring>
#include <memory>
#include <vector>

#include "csrc/core/gemm/gemm_tiles.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/ops/dot_product_attention/dot_product_attention_internal.h"

namespace tokamax {
namespace attention {
namespace {

// Few rows (decode: one position times the group): a GEMM tile would be mostly padding and
// packing K would cost more than reading it, so the row path streams K and V rows in place.
// Taken when a single query block of few rows covers the whole query sequence.
bool UseRowDots(const DotProductAttentionParams& p, int64_t q_blocks, int64_t rows) {
  return q_blocks == 1 && rows <= kMaxRowDotRows && p.k.strides[3] == 1 && p.v.strides[3] == 1;
}

// A row that saw no key has sum 0 (out 0, lse -inf); any other sum is at least 1, or NaN when a
// logit was NaN or overflowed (propagated, as the reference does: not mistaken for a masked row).
void StoreOutputRow(const DotProductAttentionParams& p, int64_t b, int64_t t, int64_t n, const float* acc, float sum,
                    float max) {
  const float inv = sum != 0.0f ? 1.0f / sum : 0.0f;
  DispatchDType(p.out.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* dst = static_cast<T*>(p.out.data) + b * p.out.strides[0] + t * p.out.strides[1] + n * p.out.strides[2];
    for (int64_t e = 0; e < p.out.sizes[3]; ++e) StoreFromFloat(dst + e * p.out.strides[3], acc[e] * inv);
    return 0;
  });
  if (p.lse != nullptr) {
    static_cast<float*>(p.lse)[b * p.lse_strides[0] + n * p.lse_strides[1] + t * p.lse_strides[2]] =
        sum != 0.0f ? max + std::log(sum) : kNegInf;
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
                 int64_t split, SplitPartials* partials, const PackedMatrixTiles& k_tiles,
                 const PackedMatrixTiles& v_tiles, const Bf16MatrixCopy* bf16_k, const Bf16MatrixCopy* bf16_vt, TaskScratch& s) {
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

  float* q_panels = bf16 ? nullptr : Scratch<float>(s, kQPanels, q_floats);
  uint16_t* q_vnni = bf16 ? Scratch<uint16_t>(s, kQVnni, q_floats) : nullptr;
  float* k_panels = Scratch<float>(s, kKPanels, k_tiles.tile_floats());
  const int64_t st_rows = std::max(RoundUp(block, mr), RoundUp(block, kBf16TileDepth));
  // P·V reads st in place as A: one key's rows per depth step, ld_st apart.
  const int64_t ld_st = SetSpreadingLd(cols);
  float* st = InPlaceTileScratch(s, kSt, st_rows, ld_st);
  float* v_panels = Scratch<float>(s, kVPanels, v_tiles.tile_floats());
  uint16_t* p_vnni = bf16 ? Scratch<uint16_t>(s, kPVnni, st_rows * cols) : nullptr;
  float* acc = Scratch<float>(s, kAcc, acc_floats);
  float* max = Scratch<float>(s, kMax, cols);
  float* sum = Scratch<float>(s, kSum, cols);
  float* sub = Scratch<float>(s, kSub, cols);
  float* alpha = Scratch<float>(s, kAlpha, cols);
  float* tile_max = Scratch<float>(s, kTileMax, cols);
  std::fill(acc, acc + acc_floats, 0.0f);
  std::fill(max, max + cols, kNegInf);
  std::fill(sum, sum + cols, 0.0f);
  std::unique_ptr<Bf16ProductScope> scope;
  if (bf16) {
    scope.reset(new Bf16ProductScope(k.bf16));
    PackRowsVnni(p.q, rows, cols, q_vnni, s);
  } else {
    float* q_rows = Scratch<float>(s, kQRows, count * d.head_dim);
    GatherRows(*k.softmax, p.q, rows, d.head_dim, p.scale, q_rows, d.head_dim);
    k.softmax->transpose_panels(q_rows, d.head_dim, count, d.head_dim, nr, q_panels);
  }
  ComputeRowMasks(p.masks, rows, d.kv_len, &s.row_masks);
  ForEachVisibleTile(p.masks, s.row_masks, rows, kv_begin, kv_end, block,
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
    UpdateRunningMax(*k.softmax, st, keys, ld_st, cols, max, sum, alpha, sub, tile_max);
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
    float* out_rows = Scratch<float>(s, kOutRows, count * d.value_dim);
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
  // A split that met a NaN logit holds a NaN sum whatever its max: the row is NaN.
  for (int64_t c = 0; c < splits; ++c) {
    if (std::isnan(partials.sum[partials.Row(d, c, b, n, t)])) sum = std::numeric_limits<float>::quiet_NaN();
  }
  StoreOutputRow(p, b, t, n, merged.data(), sum, max);
}

void ZeroOutputs(const DotProductAttentionParams& p, const Dims& d) {
  std::vector<float> zeros(d.value_dim, 0.0f);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t t = 0; t < d.q_len; ++t)
      for (int64_t n = 0; n < d.q_heads; ++n) StoreOutputRow(p, b, t, n, zeros.data(), 0.0f, kNegInf);
}

}  // namespace

bool UseBf16Products(const DotProductAttentionParams& p, const Kernels& k) {
  return k.bf16 && p.q.dtype == DType::kBFloat16 && p.k.dtype == DType::kBFloat16 && p.v.dtype == DType::kBFloat16 &&
         p.q.sizes[3] % kBf16TileDepth == 0 && p.v.sizes[3] % kBf16TileRows == 0;
}

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

}  // namespace attention

Status DotProductAttention(const DotProductAttentionParams& params, const DotProductAttentionConfig& config) {
  using namespace attention;
  Kernels k;
  Status status = BeginCall(params, config, &k);
  if (!status.ok()) return status;
  const Dims d = DimsOf(params);
  if (d.batch == 0 || d.q_len == 0 || d.q_heads == 0) return Status::Ok();
  if (params.q.dtype == DType::kFloat64) {
    DotProductAttentionReference(params);
    return Status::Ok();
  }
  if (d.kv_len == 0) {
    ZeroOutputs(params, d);
    return Status::Ok();
  }
  if (d.value_dim == 0) {
    // No output, but a logsumexp when asked for: the exact loops (serial; a degenerate shape).
    if (params.lse != nullptr) DotProductAttentionReference(params);
    return Status::Ok();
  }
  std::vector<int64_t> mask_runs;
  DotProductAttentionParams p = params;
  p.masks = FoldMaskRuns(params.masks, d, &mask_runs);
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
  const PackedMatrixTiles k_tiles(*k.gemm, p.k, config.block_kv, /*as_a=*/true, /*pack_all=*/q_blocks > 1 && !use_bf16);
  const PackedMatrixTiles v_tiles(*k.gemm, p.v, config.block_kv, /*as_a=*/false, /*pack_all=*/q_blocks > 1 && !use_bf16);
  std::unique_ptr<Bf16MatrixCopy> bf16_k, bf16_vt;
  if (use_bf16) {
    bf16_k.reset(new Bf16MatrixCopy(p.k, Bf16MatrixCopy::kRows));
    bf16_vt.reset(new Bf16MatrixCopy(p.v, Bf16MatrixCopy::kTransposed));
  }
  // Tasks are pulled from a shared counter, latest query blocks first: under a causal mask they
  // are the longest, and starting them first balances the threads.
  const int64_t task_heads = row_dots ? d.kv_heads : 1;  // kv heads per task
  const int64_t head_groups = d.kv_heads / task_heads;
  const int64_t num_tasks = d.batch * head_groups * q_blocks * splits;
  std::atomic<int64_t> next{0};
  ParallelFor(0, num_tasks, 1, [&](int64_t, int64_t) {
    TaskScratch scratch;  // once per thread and call, not per task
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

}  // namespace tokamax
