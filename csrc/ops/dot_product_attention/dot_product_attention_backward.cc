// The dot_product_attention backward: FlashAttention-2 (probabilities recomputed from the saved
// logsumexp), one task per chunk of query blocks of one (batch, kv head), dk and dv summed over
// the chunks in a fixed order.
#include <atomic>
#include <cmath>
#include <memory>
#include <vector>

#include "csrc/core/gemm/gemm_tiles.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/ops/dot_product_attention/dot_product_attention_internal.h"

namespace tokamax {
namespace attention {
namespace {

// Its backward also multiplies over Hv (V·dOᵀ), so Hv must fill whole tile depths too.
bool UseBf16ProductsBackward(const DotProductAttentionGradParams& g, const Kernels& k) {
  return UseBf16Products(g.forward, k) && g.dout.dtype == DType::kBFloat16 &&
         g.forward.v.sizes[3] % kBf16TileDepth == 0;
}

// The bf16 engine's operands of the backward: K as rows (K·Qᵀ) and transposed (Kᵀ·dS), V as rows (V·dOᵀ).
struct Bf16BackwardOperands {
  Bf16MatrixCopy k_rows, k_t, v_rows;
};

// Row r's gradient of the bias over every key, in the dense fp32 [B or 1, N, T, S] buffer the
// backward writes (one batch when the batches sum into one).
float* DbiasRow(const DotProductAttentionGradParams& g, const Dims& d, const TaskRows& rows, int64_t r) {
  const int64_t b = g.dbias_sum_batches ? 0 : rows.b;
  return static_cast<float*>(g.dbias) + ((b * d.q_heads + rows.n(r)) * d.q_len + rows.t(r)) * d.kv_len;
}

// |lse| from which fp32 holds a row's log-sum too coarsely beside its max (ulp 1.2e-4 at 1024):
// such rows get P renormalised in the backward.
constexpr float kCoarseLse = 1024.0f;

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
                  const PackedMatrixTiles& k_tiles, const PackedMatrixTiles& v_tiles,
                  const PackedMatrixTiles& k_row_tiles,
                  const Bf16BackwardOperands* bf16_ops, TaskScratch& s) {
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

  float* q_panels = Scratch<float>(s, kQPanels, max_cols * d.head_dim);
  float* q_rows = Scratch<float>(s, kQRows, max_rows * ld_dq);
  float* do_panels = Scratch<float>(s, kDoPanels, max_cols * d.value_dim);
  float* do_rows = Scratch<float>(s, kDoRows, max_rows * ld_dv);
  float* q_bpanels = Scratch<float>(s, kQBPanels, max_rows * ld_dq);
  float* do_bpanels = Scratch<float>(s, kDoBPanels, max_rows * ld_dv);
  float* k_panels = Scratch<float>(s, kKPanels, k_tiles.tile_floats());
  float* k_rows = Scratch<float>(s, kKRows, k_row_tiles.tile_floats());
  float* v_panels = Scratch<float>(s, kVPanels, v_tiles.tile_floats());
  // P, dPᵀ and the soft cap's slope as [key][row] tiles, SetSpreadingLd(cols) apart (dQ reads dS
  // in place as A).
  const int64_t max_ld_st = SetSpreadingLd(max_cols);
  float* st = Scratch<float>(s, kSt, kv_rows * max_ld_st);
  float* dpt = InPlaceTileScratch(s, kDpt, kv_rows, max_ld_st);
  float* cap_slopes = p.logits_soft_cap > 0.0f ? Scratch<float>(s, kCapSlope, kv_rows * max_ld_st) : nullptr;
  // Packed P or dS, the O rows before the first tile, and for bf16 dQ as rows after the last.
  float* a_panels = Scratch<float>(s, kAPanels, std::max({kv_rows * max_cols, max_rows * ld_dv, max_rows * ld_dq}));
  float* dq_acc = Scratch<float>(s, kDqAcc, std::max(RoundUp(max_rows, mr) * ld_dq, d.head_dim * max_cols));
  float* lse_sub = Scratch<float>(s, kLseSub, max_cols);
  float* delta = Scratch<float>(s, kDelta, max_cols);
  // bf16: the block's rows as VNNI panels over H or Hv (B of K·Qᵀ, V·dOᵀ) and over the rows
  // (B of dS·Q, P·dO), and one bf16 tile (P, then dS) as rows and as VNNI key pairs.
  uint16_t *q_vnni = nullptr, *do_vnni = nullptr, *q_row_vnni = nullptr, *do_row_vnni = nullptr;
  uint16_t *tile_rows = nullptr, *tile_vnni = nullptr;
  std::unique_ptr<Bf16ProductScope> scope;
  if (bf16) {
    q_vnni = Scratch<uint16_t>(s, kQVnni, max_cols * d.head_dim);
    do_vnni = Scratch<uint16_t>(s, kDoVnni, max_cols * d.value_dim);
    q_row_vnni = Scratch<uint16_t>(s, kQRowVnni, max_cols * d.head_dim);
    do_row_vnni = Scratch<uint16_t>(s, kDoRowVnni, max_cols * d.value_dim);
    tile_rows = Scratch<uint16_t>(s, kTileRows, kv_rows * max_cols);
    tile_vnni = Scratch<uint16_t>(s, kTileVnni, kv_rows * max_cols);
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
    // The block's rows of dbias start at 0: zeroed by the task that owns them, in parallel and
    // just before its tiles add to them. When the batches sum into one buffer, the first batch's
    // tasks zero it: the pools run in batch order (DotProductAttentionBackward).
    if (g.dbias != nullptr && (!g.dbias_sum_batches || b == 0)) {
      for (int64_t r = 0; r < count; ++r) std::fill_n(DbiasRow(g, d, rows, r), d.kv_len, 0.0f);
    }
    const int64_t dq_floats = bf16 ? d.head_dim * cols : row_panels * mr * ld_dq;
    std::fill(dq_acc, dq_acc + dq_floats, 0.0f);
    // A block no row of which sees a key (past its length) has dq = 0 and needs no operands.
    const bool any_visible = s.row_masks.max_end > 0;
    bool coarse = false;
    if (any_visible) {
      // Per row: lse (0 for rows that see nothing: their logits are all -inf, so P = 0).
      std::fill(lse_sub, lse_sub + cols, 0.0f);
      s.dead_rows.clear();
      for (int64_t r = 0; r < count; ++r) {
        const int64_t t = rows.t(r), n = rows.n(r);
        const float lse = static_cast<const float*>(p.lse)[b * p.lse_strides[0] + n * p.lse_strides[1] + t * p.lse_strides[2]];
        lse_sub[r] = lse == kNegInf ? 0.0f : lse;
        if (lse == kNegInf) s.dead_rows.push_back(r);
        coarse = coarse || (std::isfinite(lse) && std::fabs(lse) >= kCoarseLse);  // not dead (-inf) rows
      }
      // The block's operands: Q (scaled, or for bf16 exact) and dO as rows, and transposed. A row
      // that sees no key sends exactly zero gradients whatever its q and dO hold (NaN in a padded
      // row included): its rows are zeroed here, its dS below.
      GatherRows(*k.softmax, p.q, rows, d.head_dim, bf16 ? 1.0f : p.scale, q_rows, ld_dq);
      GatherRows(*k.softmax, g.dout, rows, d.value_dim, 1.0f, do_rows, ld_dv);
      for (const int64_t r : s.dead_rows) {
        std::fill_n(q_rows + r * ld_dq, d.head_dim, 0.0f);
        std::fill_n(do_rows + r * ld_dv, d.value_dim, 0.0f);
      }
      if (bf16) {
        PackRowsVnni(p.q, rows, cols, q_vnni, s);
        PackRowsVnni(g.dout, rows, cols, do_vnni, s);
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
      // Per row: delta = rowsum(dO ∘ O) - dlse.
      std::fill(delta, delta + cols, 0.0f);
      float* out_rows = a_panels;  // free until the first tile
      GatherRows(*k.softmax, out, rows, d.value_dim, 1.0f, out_rows, ld_dv);
      for (int64_t r = 0; r < count; ++r) {
        const int64_t t = rows.t(r), n = rows.n(r);
        float dot = 0.0f;
        for (int64_t e = 0; e < d.value_dim; ++e) dot += do_rows[r * ld_dv + e] * out_rows[r * ld_dv + e];
        if (g.dlse != nullptr) {
          dot -= static_cast<const float*>(g.dlse)[b * g.dlse_strides[0] + n * g.dlse_strides[1] + t * g.dlse_strides[2]];
        }
        delta[r] = dot;
      }
    }
    // P = exp(logits - lse) of tile [s0, s0 + keys), recomputed; `sums` (when set) adds up its
    // columns.
    auto probabilities = [&](int64_t s0, TileVisibility visibility, int64_t keys, float* slopes, float* sums) {
      if (bf16) {
        k.bf16.gemm(RoundUp(keys, kBf16TileRows), cols, d.head_dim, bf16_ops->k_rows.At(b, kv_head, s0),
                    bf16_ops->k_rows.ld(), q_vnni, st, ld_st, false, p.scale);
      } else {
        TileGemm(gemm, d.head_dim, k_tiles.Tile(b, kv_head, s0, keys, k_panels), CeilDiv(keys, mr),
                 PackedB(q_panels, d.head_dim, nr), cols / nr, st, ld_st, false);
      }
      FinishLogits(p, k, rows, s.row_masks, s0, keys, visibility, st, ld_st, slopes);
      k.softmax->exp_columns(st, keys, ld_st, cols, lse_sub, sums);
    };
    if (any_visible && coarse) {
      // A row whose |lse| is so large that fp32 cannot hold its log-sum apart from its max (all
      // its logits near -3.4e38, as an additive mask of finfo.min over a whole row, or past
      // ~1e3 in magnitude) gets P's row sum far from 1: a first pass over the tiles adds it up,
      // and P is divided by it (exactly 1 for the other rows, whose bits do not change).
      s.renorm.assign(static_cast<size_t>(cols), 0.0f);
      ForEachVisibleTile(p.masks, s.row_masks, rows, 0, d.kv_len, block,
                         [&](int64_t s0, TileVisibility visibility, int64_t keys) {
        probabilities(s0, visibility, keys, nullptr, s.renorm.data());
      });
      for (int64_t c = 0; c < cols; ++c) {
        const bool coarse_row = c < count && std::isfinite(lse_sub[c]) && std::fabs(lse_sub[c]) >= kCoarseLse &&
                                s.renorm[c] > 0.0f;
        s.renorm[c] = coarse_row ? 1.0f / s.renorm[c] : 1.0f;
      }
    }
    if (any_visible) {
      ForEachVisibleTile(p.masks, s.row_masks, rows, 0, d.kv_len, block,
                         [&](int64_t s0, TileVisibility visibility, int64_t keys) {
        const int64_t key_panels = CeilDiv(keys, mr);
        const int64_t key_tiles = RoundUp(keys, kBf16TileRows);  // bf16: rows of the key-major products
        probabilities(s0, visibility, keys, cap_slopes, nullptr);
        if (coarse) k.softmax->scale_columns(st, ld_st, keys, cols, s.renorm.data());
        // dV_tile += P · dO; dPᵀ = V_tile · dOᵀ.
        if (bf16) {
          // P's rows past `keys` are zero: they must add nothing to the next tile's dV rows.
          ConvertRowsBf16(st, ld_st, keys, key_tiles, cols, tile_rows, cols);
          k.bf16.gemm(key_tiles, d.value_dim, cols, tile_rows, cols, do_row_vnni, dv_acc + s0 * ld_dv, ld_dv, true,
                      1.0f);
          k.bf16.gemm(key_tiles, cols, d.value_dim, bf16_ops->v_rows.At(b, kv_head, s0), bf16_ops->v_rows.ld(), do_vnni,
                      dpt, ld_st, false, 1.0f);
        } else {
          gemm.pack_a({st, DType::kFloat32, keys, count, ld_st, 1}, 0, keys, 0, count, nullptr, a_panels);
          TileGemm(gemm, count, PackedA(a_panels, count, mr), key_panels, PackedB(do_bpanels, count, nr), ld_dv / nr,
                   dv_acc + s0 * ld_dv, ld_dv, true);
          TileGemm(gemm, d.value_dim, v_tiles.Tile(b, kv_head, s0, keys, v_panels), key_panels,
                   PackedB(do_panels, d.value_dim, nr), cols / nr, dpt, ld_st, false);
        }
        // dS = P ∘ (dP - delta), times the soft cap's derivative.
        k.softmax->softmax_grad_columns(st, dpt, keys, ld_st, cols, delta);
        if (cap_slopes != nullptr) {  // the real rows: soft_cap writes no slope for padding columns
          for (int64_t j = 0; j < keys; ++j) {
            for (int64_t r = 0; r < count; ++r) dpt[j * ld_st + r] *= cap_slopes[j * ld_st + r];
          }
        }
        // Last: a dead row's slope is NaN when its raw q is (the bf16 engine reads q unzeroed).
        for (const int64_t r : s.dead_rows) {
          for (int64_t j = 0; j < keys; ++j) dpt[j * ld_st + r] = 0.0f;
        }
        if (g.dbias != nullptr) {
          for (int64_t r = 0; r < count; ++r) {
            float* dst = DbiasRow(g, d, rows, r) + s0;
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
          gemm.pack_a({dpt, DType::kFloat32, keys, count, ld_st, 1}, 0, keys, 0, count, nullptr, a_panels);
          TileGemm(gemm, count, PackedA(a_panels, count, mr), key_panels, PackedB(q_bpanels, count, nr), ld_dk / nr,
                   dk_acc + s0 * ld_dk, ld_dk, true);
          TileGemm(gemm, keys, InPlaceA(dpt, ld_st, mr), row_panels, k_row_tiles.Tile(b, kv_head, s0, keys, k_rows),
                   ld_dq / nr, dq_acc, ld_dq, true);
        }
      });
    }
    float* dq_rows = dq_acc;
    int64_t ld_rows = ld_dq;
    if (bf16) {  // dQᵀ back to rows
      k.softmax->transpose_panels(dq_acc, cols, d.head_dim, count, d.head_dim, a_panels);
      dq_rows = a_panels;
      ld_rows = d.head_dim;
    }
    for (int64_t r = 0; r < count; ++r) {
      StoreRow(gemm, g.dq, b, rows.t(r), rows.n(r), dq_rows + r * ld_rows, d.head_dim, p.scale);
    }
  }
}

}  // namespace
}  // namespace attention

// The backward splits each (batch, kv head)'s query blocks into this many tasks.
int64_t BackwardSplits(int64_t q_len, const DotProductAttentionConfig& config) {
  const int64_t q_blocks = q_len > 0 ? CeilDiv(q_len, config.block_q) : 0;
  return std::max<int64_t>(1, std::min(config.num_splits, q_blocks));
}

int64_t DotProductAttentionBackwardTasksPerBatch(int64_t q_len, int64_t kv_heads,
                                                 const DotProductAttentionConfig& config) {
  return kv_heads * BackwardSplits(q_len, config);
}

Status DotProductAttentionBackward(const DotProductAttentionGradParams& params,
                                   const DotProductAttentionConfig& config) {
  using namespace attention;
  Kernels k;
  Status status = BeginCall(params.forward, config, &k);
  if (!status.ok()) return status;
  const Dims d = DimsOf(params.forward);
  if (params.forward.lse == nullptr && d.batch * d.q_heads * d.q_len > 0) {
    return Status::Error("dot_product_attention backward: the forward's logsumexp is required");
  }
  if (params.forward.q.dtype == DType::kFloat64) {
    DotProductAttentionBackwardReference(params);
    return Status::Ok();
  }
  std::vector<int64_t> mask_runs;
  DotProductAttentionGradParams g = params;
  g.forward.masks = FoldMaskRuns(params.forward.masks, d, &mask_runs);
  const DotProductAttentionParams& p = g.forward;
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
  // Several query blocks read each kv tile: pack K, V and K's rows once.
  const bool use_bf16 = UseBf16ProductsBackward(g, k) && d.kv_len > 0;
  const bool pack_all = q_blocks > 1 && d.kv_len > 0 && !use_bf16;
  std::unique_ptr<Bf16BackwardOperands> bf16_ops;
  if (use_bf16) {
    bf16_ops.reset(new Bf16BackwardOperands{Bf16MatrixCopy(p.k, Bf16MatrixCopy::kRows),
                                            Bf16MatrixCopy(p.k, Bf16MatrixCopy::kTransposed),
                                            Bf16MatrixCopy(p.v, Bf16MatrixCopy::kRows)});
  }
  const PackedMatrixTiles k_tiles(*k.gemm, p.k, config.block_kv, /*as_a=*/true, pack_all);
  const PackedMatrixTiles v_tiles(*k.gemm, p.v, config.block_kv, /*as_a=*/true, pack_all);
  const PackedMatrixTiles k_row_tiles(*k.gemm, p.k, config.block_kv, /*as_a=*/false, pack_all);
  // Tasks (split, batch, kv head) in one pool; when dbias sums the batches, one pool per batch,
  // in batch order (each element of dbias then has one writer at a time, and its sum a fixed
  // order).
  const int64_t pools = g.dbias != nullptr && g.dbias_sum_batches ? d.batch : 1;
  const int64_t heads_per_pool = heads / std::max<int64_t>(pools, 1);
  for (int64_t pool = 0; pool < pools; ++pool) {
    const int64_t num_tasks = heads_per_pool * splits;
    std::atomic<int64_t> next{0};
    ParallelFor(0, num_tasks, 1, [&](int64_t, int64_t) {
      TaskScratch scratch;  // once per thread and call, not per task
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
      // bf16: dS·Q unscaled
      StoreRow(*k.gemm, g.dk, b, s, kv_head, total.data(), d.head_dim, use_bf16 ? p.scale : 1.0f);
      sum_splits(dv_acc, ld_dv, d.value_dim);
      StoreRow(*k.gemm, g.dv, b, s, kv_head, total.data(), d.value_dim, 1.0f);
    }
  });
  return Status::Ok();
}

}  // namespace tokamax
