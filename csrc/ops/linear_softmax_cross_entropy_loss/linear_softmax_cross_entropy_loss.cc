// The linear_softmax_cross_entropy_loss CPU kernels (see the header for the schedule): logits
// tiles on the GEMM core, column loops from the tier's table (float64 through plain loops).
#include "csrc/ops/linear_softmax_cross_entropy_loss/linear_softmax_cross_entropy_loss.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "csrc/core/base/int_math.h"
#include "csrc/core/gemm/gemm.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/core/runtime/scratch_arena.h"
#include "csrc/core/softmax/softmax_kernels.h"
#include "csrc/core/vec/tiers.h"

namespace tokamax {

TOKAMAX_DECLARE_IN_TIERS(const LinearCrossEntropyKernels& LinearCrossEntropyKernelTable();)

// The avx512bf16 and amx tiers add nothing to fp32 column loops: they run the avx512 one.
const LinearCrossEntropyKernels& GetLinearCrossEntropyKernels(Isa isa) {
  TOKAMAX_RETURN_BY_VECTOR_WIDTH(isa, LinearCrossEntropyKernelTable());
}

namespace {

constexpr const char* kOp = "linear_softmax_cross_entropy_loss";
// The column loops work on whole 16-wide groups of batch rows.
constexpr int64_t kColumns = 16;
static_assert(ConfigFieldNamed<LinearCrossEntropyConfig>("row_block").multiple_of % kColumns == 0,
              "row_block: whole column groups");
// GEMM blocking beside the config's block_k: 192 rows are whole 12-row (avx512) and 16-row
// (bf16 engine) tiles, 192 x 256 fp32 packed rows take ~200 KiB of a 1-2 MiB L2; 512-wide column
// blocks amortise packing A.
constexpr int64_t kBlockM = 192;
constexpr int64_t kBlockN = 512;
// Rows of dW per task of the backward's phase B: one GEMM column block, so each task packs the strip
// once (no effect on the bits).
constexpr int64_t kHiddenChunk = 512;

enum Slot : int { kTileSlot, kStatsSlot, kRowGradSlot };

Status CheckLabels(const LinearCrossEntropyParams& p) {
  const int64_t batch = p.x.sizes[0], vocab = p.w.sizes[1];
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t label = p.labels[r * p.labels_stride];
    if (label == p.ignore_index || (label >= 0 && label < vocab)) continue;
    return Status::Error(std::string(kOp) + ": labels must be in [0, " + std::to_string(vocab) +
                         ") (V, the vocabulary) or ignore_index (" + std::to_string(p.ignore_index) + "), got " +
                         std::to_string(label) + " at row " + std::to_string(r));
  }
  return Status::Ok();
}

Status CheckViews(const LinearCrossEntropyParams& p) {
  if (p.x.dtype != p.w.dtype) return Status::Error(std::string(kOp) + ": x and weights must have one dtype");
  if (p.x.sizes[1] != p.w.sizes[0]) return Status::Error(std::string(kOp) + ": x[B, H] and weights[H, V] disagree on H");
  return CheckLabels(p);
}

// The GEMM views. Wt(v0, rows) is W[:, v0:v0+rows]ᵀ ([rows, H]); Xt(r0, cols) is x[r0:r0+cols]ᵀ.
ConstMatrix Wt(const StridedView<2>& w, int64_t v0, int64_t rows) {
  return {w.At(0, v0), w.dtype, rows, w.sizes[0], w.strides[1], w.strides[0]};
}
ConstMatrix Xt(const StridedView<2>& x, int64_t r0, int64_t cols) {
  return {x.At(r0, 0), x.dtype, x.sizes[1], cols, x.strides[1], x.strides[0]};
}

GemmBlocking Blocking(const LinearCrossEntropyConfig& config) {
  GemmBlocking blocking;
  blocking.block_m = kBlockM;
  blocking.block_k = config.block_k;
  blocking.block_n = kBlockN;
  return blocking;
}

// float64 column loops: the same math as the tiered table, plain loops (gradcheck, oracles).
void ForwardTileDouble(const double* z, int64_t rows, int64_t ld, int64_t cols, double* max, double* sum,
                       double* zsum) {
  for (int64_t c = 0; c < cols; ++c) {
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < rows; ++v) m = std::max(m, z[v * ld + c]);
    const double new_max = std::max(max[c], m);
    double total = max[c] == -std::numeric_limits<double>::infinity() ? 0.0 : sum[c] * std::exp(max[c] - new_max);
    double zs = 0.0;
    for (int64_t v = 0; v < rows; ++v) {
      total += std::exp(z[v * ld + c] - new_max);
      zs += z[v * ld + c];
    }
    max[c] = new_max;
    sum[c] = total;
    if (zsum != nullptr) zsum[c] += zs;
  }
}

void BackwardTileDouble(const double* z, int64_t rows, int64_t ld, int64_t cols, const double* lse, const double* a,
                        const double* b, const double* label_row, const double* c1, double cap_inv_sq, double* out,
                        int64_t out_ld) {
  for (int64_t v = 0; v < rows; ++v) {
    for (int64_t c = 0; c < cols; ++c) {
      const double zc = z[v * ld + c];
      double d = a[c] * std::exp(zc - lse[c]) - b[c] - (static_cast<double>(v) == label_row[c] ? c1[c] : 0.0);
      if (cap_inv_sq != 0.0) d *= 1.0 - zc * zc * cap_inv_sq;
      out[v * out_ld + c] = d;
    }
  }
}

// Acc is float (fp32, bf16, fp16 inputs) or double (float64).
template <typename Acc>
struct Kernel {
  const LinearCrossEntropyParams& p;
  const LinearCrossEntropyConfig& config;
  const LinearCrossEntropyConfig& grad_config;  // the fold's gradient products (LinearCrossEntropy)
  const GemmKernels& gemm;
  const LinearCrossEntropyKernels& columns;
  const SoftmaxKernels& softmax;  // its soft cap
  int64_t batch, hidden, vocab;
  DType acc_dtype = std::is_same_v<Acc, double> ? DType::kFloat64 : DType::kFloat32;

  Kernel(const LinearCrossEntropyParams& params, const LinearCrossEntropyConfig& c, const LinearCrossEntropyConfig& g,
         Isa isa)
      : p(params), config(c), grad_config(g), gemm(GetGemmKernels(isa)), columns(GetLinearCrossEntropyKernels(isa)),
        softmax(GetSoftmaxKernels(isa)), batch(params.x.sizes[0]), hidden(params.x.sizes[1]), vocab(params.w.sizes[1]) {}

  int64_t Label(int64_t r) const { return p.labels[r * p.labels_stride]; }
  bool Ignored(int64_t r) const { return Label(r) == p.ignore_index; }

  // tile[v][c] = logits of vocab v0 + v, batch row r0 + c (capped), for v < rows, c < n.
  void LogitsTile(int64_t r0, int64_t n, int64_t v0, int64_t rows, Acc* tile, int64_t ld) const {
    const MutableMatrix c{tile, acc_dtype, rows, n, ld, 1};
    GemmRegion(gemm, Wt(p.w, v0, rows), Xt(p.x, r0, n), c, 0, rows, 0, n, Blocking(config));
    if (p.logits_soft_cap <= 0) return;
    if constexpr (std::is_same_v<Acc, double>) {
      const double cap = p.logits_soft_cap, inv = 1.0 / cap;
      for (int64_t v = 0; v < rows; ++v) {
        for (int64_t j = 0; j < n; ++j) tile[v * ld + j] = cap * std::tanh(tile[v * ld + j] * inv);
      }
    } else {
      softmax.soft_cap(tile, rows, ld, n, static_cast<float>(p.logits_soft_cap), nullptr, 0);
    }
  }

  void ForwardTile(const Acc* z, int64_t rows, int64_t ld, int64_t cols, Acc* max, Acc* sum, Acc* zsum) const {
    if constexpr (std::is_same_v<Acc, double>) {
      ForwardTileDouble(z, rows, ld, cols, max, sum, zsum);
    } else {
      columns.forward_tile(z, rows, ld, cols, max, sum, zsum);
    }
  }

  Status Forward() const {
    if (p.dx.data != nullptr || p.dw.data != nullptr) return ForwardFold();
    const int64_t vt = config.vocab_block, rb = config.row_block;
    Acc* lse = static_cast<Acc*>(p.lse);
    LargeBuffer<Acc> row_loss_buffer(p.reduction == LossReduction::kNone ? 0 : batch, LargeBuffer<Acc>::kUninitialized);
    Acc* row_loss = p.reduction == LossReduction::kNone ? static_cast<Acc*>(p.loss) : row_loss_buffer.data();
    const bool smoothing = p.label_smoothing != 0.0;
    ParallelFor(0, CeilDiv(batch, rb), 1, [&](int64_t begin, int64_t end) {
      ScratchLease lease;
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t r0 = blk * rb, n = std::min(rb, batch - r0), cols = RoundUp(n, kColumns);
        Acc* tile = lease.Get<Acc>(kTileSlot, vt * cols);
        std::fill(tile, tile + vt * cols, Acc(0));  // the padded columns stay 0 (finite)
        Acc* stats = lease.Get<Acc>(kStatsSlot, 4 * cols);
        Acc *max = stats, *sum = stats + cols, *zsum = stats + 2 * cols, *zy = stats + 3 * cols;
        std::fill(max, max + cols, -std::numeric_limits<Acc>::infinity());
        std::fill(sum, sum + 3 * cols, Acc(0));
        for (int64_t v0 = 0; v0 < vocab; v0 += vt) {
          const int64_t rows = std::min(vt, vocab - v0);
          LogitsTile(r0, n, v0, rows, tile, cols);
          for (int64_t j = 0; j < n; ++j) {
            const int64_t label = Label(r0 + j);
            if (label >= v0 && label < v0 + rows && label != p.ignore_index) zy[j] = tile[(label - v0) * cols + j];
          }
          ForwardTile(tile, rows, cols, cols, max, sum, smoothing ? zsum : nullptr);
        }
        FinishRows(r0, n, max, sum, zsum, zy, lse, row_loss);
      }
    });
    ReduceLoss(row_loss);
    return Status::Ok();
  }

  // lse and loss of rows r0.. r0+n from their column statistics (the forward's last step).
  void FinishRows(int64_t r0, int64_t n, const Acc* max, const Acc* sum, const Acc* zsum, const Acc* zy, Acc* lse,
                  Acc* row_loss) const {
    for (int64_t j = 0; j < n; ++j) {
      const Acc l = max[j] + std::log(sum[j]);
      lse[r0 + j] = l;
      Acc loss = 0;
      if (!Ignored(r0 + j)) {
        loss = l - zy[j];
        if (p.label_smoothing != 0.0) {
          const Acc eps = static_cast<Acc>(p.label_smoothing);
          loss = (Acc(1) - eps) * loss + eps * (l - zsum[j] / static_cast<Acc>(vocab));
        }
        if (p.z_loss_weight != 0.0) loss += static_cast<Acc>(p.z_loss_weight) * l * l;
      }
      row_loss[r0 + j] = loss;
    }
  }

  void ReduceLoss(const Acc* row_loss) const {
    if (p.reduction == LossReduction::kNone) return;
    // One thread, row order, in double: the sum's bits do not depend on the thread count.
    double total = 0.0;
    for (int64_t r = 0; r < batch; ++r) total += static_cast<double>(row_loss[r]);
    if (p.reduction == LossReduction::kMean) total = Counted() == 0 ? 0.0 : total / static_cast<double>(Counted());
    *static_cast<Acc*>(p.loss) = static_cast<Acc>(total);
  }

  int64_t Counted() const {
    int64_t counted = 0;
    for (int64_t r = 0; r < batch; ++r) counted += Ignored(r) ? 0 : 1;
    return counted;
  }

  // Row r's dlogit_v = a·p_v - b - [v == y]·c1 for its loss's upstream gradient g (mean's 1/count
  // included by the caller); lse's own upstream gradient adds to a (d lse / d z_v = p_v).
  void RowCoefficients(int64_t r, Acc g, Acc lse_r, Acc* a, Acc* b, Acc* c1) const {
    if (Ignored(r)) return;
    const Acc eps = static_cast<Acc>(p.label_smoothing);
    *a += p.z_loss_weight != 0.0 ? g * (Acc(1) + Acc(2) * static_cast<Acc>(p.z_loss_weight) * lse_r) : g;
    *b = p.label_smoothing != 0.0 ? g * eps / static_cast<Acc>(vocab) : Acc(0);
    *c1 = p.label_smoothing != 0.0 ? g * (Acc(1) - eps) : g;
  }

  Acc CapInvSq() const {
    return p.logits_soft_cap > 0 ? Acc(1) / static_cast<Acc>(p.logits_soft_cap * p.logits_soft_cap) : Acc(0);
  }

  // dlogits of tile z (rows vocab entries from v0, cols batch columns from r0) into out.
  void DlogitsTile(Acc* z, int64_t r0, int64_t n, int64_t v0, int64_t rows, int64_t ld, const Acc* lse_r,
                   const Acc* a, const Acc* b, const Acc* c1, Acc* label_row, void* out, DType out_dtype,
                   int64_t out_ld) const {
    for (int64_t j = 0; j < ld; ++j) {
      label_row[j] = j < n && !Ignored(r0 + j) ? static_cast<Acc>(Label(r0 + j) - v0) : Acc(-1);
    }
    if constexpr (std::is_same_v<Acc, double>) {
      BackwardTileDouble(z, rows, ld, ld, lse_r, a, b, label_row, c1, CapInvSq(), static_cast<double*>(out), out_ld);
    } else {
      columns.backward_tile(z, rows, ld, ld, lse_r, a, b, label_row, c1, CapInvSq(), out, out_dtype, out_ld);
    }
  }

  // The dlogits strip's dtype: bf16 for bf16 operands (the bf16 engine's input), else Acc.
  DType StripDType() const {
    return std::is_same_v<Acc, double> ? DType::kFloat64
           : p.x.dtype == DType::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
  }

  // The forward with the gradient for dloss = 1 folded in (the header's schedule).
  Status ForwardFold() const {
    const int64_t vt = config.vocab_block, rb = LinearCrossEntropyFoldRows(config, vocab);
    const int64_t tiles = CeilDiv(vocab, vt), chunks = CeilDiv(hidden, kHiddenChunk);
    const int64_t gvt = grad_config.vocab_block, grad_tiles = CeilDiv(vocab, gvt);
    const int64_t block_cols = RoundUp(std::min(rb, std::max<int64_t>(batch, 1)), kColumns);
    Acc* lse = static_cast<Acc*>(p.lse);
    LargeBuffer<Acc> row_loss(batch, LargeBuffer<Acc>::kUninitialized);
    const int64_t counted = Counted();
    const Acc g = p.reduction == LossReduction::kMean ? (counted == 0 ? Acc(0) : Acc(1) / static_cast<Acc>(counted))
                                                      : Acc(1);
    const DType strip_dtype = StripDType();
    const bool narrow = strip_dtype != acc_dtype;
    // The block's logits, turned into dlogits in place (fp32) or into `narrow_strip` (bf16).
    LargeBuffer<Acc> block(vocab * block_cols, LargeBuffer<Acc>::kUninitialized);
    LargeBuffer<char> narrow_strip(narrow ? vocab * block_cols * DTypeSize(strip_dtype) : 0,
                                   LargeBuffer<char>::kUninitialized);
    std::vector<Acc> stats(8 * block_cols);
    const bool want_dx = p.dx.data != nullptr, want_dw = p.dw.data != nullptr;
    const GemmBlocking blocking = Blocking(grad_config);
    const bool dw_transposed = want_dw && p.dw.strides[1] != 1 && p.dw.strides[0] == 1;  // nn.Linear's layout
    if (want_dw && batch == 0) {
      for (int64_t h = 0; h < hidden; ++h) {
        for (int64_t v = 0; v < vocab; ++v) *static_cast<Acc*>(p.dw.At(h, v)) = Acc(0);
      }
    }
    for (int64_t r0 = 0; r0 < batch; r0 += rb) {
      const int64_t n = std::min(rb, batch - r0), cols = RoundUp(n, kColumns);
      Acc* z = block.data();
      // (1) the logits, by vocab tiles; padded columns 0 (finite).
      ParallelFor(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t v0 = t * vt, rows = std::min(vt, vocab - v0);
          if (n < cols) {
            for (int64_t v = v0; v < v0 + rows; ++v) std::fill(z + v * cols + n, z + (v + 1) * cols, Acc(0));
          }
          LogitsTile(r0, n, v0, rows, z + v0 * cols, cols);
        }
      });
      // (2) lse and loss, by 16-column groups: the plain forward's tile order per column.
      Acc *max = stats.data(), *sum = max + cols, *zsum = sum + cols, *zy = zsum + cols;
      Acc *a = zy + cols, *b = a + cols, *c1 = b + cols, *lse_blk = c1 + cols;
      std::fill(max, max + cols, -std::numeric_limits<Acc>::infinity());
      std::fill(sum, sum + 7 * cols, Acc(0));
      ParallelFor(0, cols / kColumns, 1, [&](int64_t begin, int64_t end) {
        for (int64_t c0 = begin * kColumns; c0 < end * kColumns; c0 += kColumns) {
          for (int64_t v0 = 0; v0 < vocab; v0 += vt) {
            ForwardTile(z + v0 * cols + c0, std::min(vt, vocab - v0), cols, kColumns, max + c0, sum + c0,
                        p.label_smoothing != 0.0 ? zsum + c0 : nullptr);
          }
        }
      });
      for (int64_t j = 0; j < n; ++j) {
        if (!Ignored(r0 + j)) zy[j] = z[Label(r0 + j) * cols + j];
      }
      FinishRows(r0, n, max, sum, zsum, zy, lse, row_loss.data());
      for (int64_t j = 0; j < n; ++j) {
        lse_blk[j] = lse[r0 + j];
        RowCoefficients(r0 + j, g, lse_blk[j], a + j, b + j, c1 + j);
      }
      // (3) dlogits for dloss = 1, by vocab tiles.
      char* d = narrow ? narrow_strip.data() : reinterpret_cast<char*>(z);
      const int64_t d_size = DTypeSize(strip_dtype);
      ParallelFor(0, grad_tiles, 1, [&](int64_t begin, int64_t end) {
        ScratchLease lease;
        Acc* label_row = lease.Get<Acc>(kStatsSlot, cols);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t v0 = t * gvt, rows = std::min(gvt, vocab - v0);
          DlogitsTile(z + v0 * cols, r0, n, v0, rows, cols, lse_blk, a, b, c1, label_row, d + v0 * cols * d_size,
                      strip_dtype, cols);
        }
      });
      // (4) dx[block] = dlogits · Wᵀ, all of V deep, by chunks of H.
      if (want_dx) {
        const ConstMatrix dlogits{d, strip_dtype, n, vocab, 1, cols};
        const ConstMatrix w_t{p.w.data, p.w.dtype, vocab, hidden, p.w.strides[1], p.w.strides[0]};
        const MutableMatrix c{p.dx.At(r0, 0), acc_dtype, n, hidden, p.dx.strides[0], p.dx.strides[1]};
        ParallelFor(0, chunks, 1, [&](int64_t begin, int64_t end) {
          GemmRegion(gemm, dlogits, w_t, c, 0, n, begin * kHiddenChunk, std::min(hidden, end * kHiddenChunk),
                     blocking);
        });
      }
      // (5) dW += x[block]ᵀ · dlogits (written by the first block), in block order.
      if (!want_dw) continue;
      GemmEpilogue epilogue;
      epilogue.accumulate = r0 > 0;
      if (dw_transposed) {  // dWᵀ[V, H] += dlogitsᵀ · x[block], by vocab tiles
        const ConstMatrix dlogits_t{d, strip_dtype, vocab, n, cols, 1};
        const ConstMatrix x_blk{p.x.At(r0, 0), p.x.dtype, n, hidden, p.x.strides[0], p.x.strides[1]};
        const MutableMatrix c{p.dw.data, acc_dtype, vocab, hidden, p.dw.strides[1], p.dw.strides[0]};
        ParallelFor(0, grad_tiles, 1, [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            GemmRegion(gemm, dlogits_t, x_blk, c, t * gvt, std::min(vocab, (t + 1) * gvt), 0, hidden, blocking,
                       epilogue);
          }
        });
      } else {  // dW[H, V] += x[block]ᵀ · dlogits, by chunks of H
        const ConstMatrix x_t{p.x.At(r0, 0), p.x.dtype, hidden, n, p.x.strides[1], p.x.strides[0]};
        const ConstMatrix dlogits{d, strip_dtype, n, vocab, 1, cols};
        const MutableMatrix c{p.dw.data, acc_dtype, hidden, vocab, p.dw.strides[0], p.dw.strides[1]};
        ParallelFor(0, chunks, 1, [&](int64_t begin, int64_t end) {
          GemmRegion(gemm, x_t, dlogits, c, begin * kHiddenChunk, std::min(hidden, end * kHiddenChunk), 0, vocab,
                     blocking, epilogue);
        });
      }
    }
    ReduceLoss(row_loss.data());
    return Status::Ok();
  }

  Status Backward() const {
    const int64_t vt = config.vocab_block, rb = config.row_block;
    const int64_t padded_batch = RoundUp(batch, kColumns);
    const Acc* lse = static_cast<const Acc*>(p.lse);
    const Acc* dloss = static_cast<const Acc*>(p.dloss);
    const Acc* dlse = static_cast<const Acc*>(p.dlse);
    // Per batch row: g = its loss's upstream gradient; dlogit_v = a·p_v - b - [v == y]·c1, and
    // lse's own upstream gradient adds to a (d lse / d z_v = p_v).
    std::vector<Acc> coef(4 * padded_batch, Acc(0));
    Acc *a = coef.data(), *b = a + padded_batch, *c1 = b + padded_batch, *lse_padded = c1 + padded_batch;
    const int64_t counted = Counted();
    for (int64_t r = 0; r < batch; ++r) {
      lse_padded[r] = lse[r];
      if (dlse != nullptr) a[r] = dlse[r];
      if (dloss == nullptr) continue;
      Acc g = p.reduction == LossReduction::kNone ? dloss[r] : dloss[0];
      if (p.reduction == LossReduction::kMean) g = g / static_cast<Acc>(counted);
      RowCoefficients(r, g, lse[r], a + r, b + r, c1 + r);
    }
    // The dlogits strip [vocab_block, B].
    const DType strip_dtype = StripDType();
    const int64_t strip_size = DTypeSize(strip_dtype);
    LargeBuffer<char> strip(vt * padded_batch * strip_size, LargeBuffer<char>::kUninitialized);
    // dx accumulates over the vocab tiles in Acc: in dx itself when it is Acc with contiguous rows.
    const bool want_dx = p.dx.data != nullptr, want_dw = p.dw.data != nullptr;
    const bool dx_in_place = want_dx && p.dx.dtype == acc_dtype && p.dx.strides[1] == 1;
    LargeBuffer<Acc> dx_buffer(want_dx && !dx_in_place ? batch * hidden : 0, LargeBuffer<Acc>::kZeroed);
    Acc* dx_acc = dx_in_place ? static_cast<Acc*>(p.dx.data) : dx_buffer.data();
    const int64_t dx_ld = dx_in_place ? p.dx.strides[0] : hidden;
    if (dx_in_place) {
      for (int64_t r = 0; r < batch; ++r) std::fill(dx_acc + r * dx_ld, dx_acc + r * dx_ld + hidden, Acc(0));
    }
    const GemmBlocking blocking = Blocking(config);
    for (int64_t v0 = 0; v0 < vocab; v0 += vt) {
      const int64_t rows = std::min(vt, vocab - v0);
      // (A) the strip's columns and dx, by blocks of batch rows.
      ParallelFor(0, CeilDiv(batch, rb), 1, [&](int64_t begin, int64_t end) {
        ScratchLease lease;
        for (int64_t blk = begin; blk < end; ++blk) {
          const int64_t r0 = blk * rb, n = std::min(rb, batch - r0), cols = RoundUp(n, kColumns);
          Acc* tile = lease.Get<Acc>(kTileSlot, vt * cols);
          std::fill(tile, tile + vt * cols, Acc(0));
          Acc* label_row = lease.Get<Acc>(kStatsSlot, cols);
          LogitsTile(r0, n, v0, rows, tile, cols);
          char* out = strip.data() + r0 * strip_size;
          DlogitsTile(tile, r0, n, v0, rows, cols, lse_padded + r0, a + r0, b + r0, c1 + r0, label_row, out,
                      strip_dtype, padded_batch);
          if (!want_dx) continue;
          Acc* dx_tile = lease.Get<Acc>(kRowGradSlot, n * hidden);
          const ConstMatrix dlogits{out, strip_dtype, n, rows, 1, padded_batch};
          const ConstMatrix w_t{p.w.At(0, v0), p.w.dtype, rows, hidden, p.w.strides[1], p.w.strides[0]};
          GemmRegion(gemm, dlogits, w_t, MutableMatrix{dx_tile, acc_dtype, n, hidden, hidden, 1}, 0, n, 0, hidden,
                     blocking);
          for (int64_t j = 0; j < n; ++j) {
            Acc* dst = dx_acc + (r0 + j) * dx_ld;
            const Acc* src = dx_tile + j * hidden;
            for (int64_t h = 0; h < hidden; ++h) dst[h] += src[h];
          }
        }
      });
      if (!want_dw) continue;
      // (B) dW[:, v0:v0+rows] = xᵀ · dlogits, the whole batch deep, by chunks of H.
      const char* dz = strip.data();
      ParallelFor(0, CeilDiv(hidden, kHiddenChunk), 1, [&](int64_t begin, int64_t end) {
        const int64_t h0 = begin * kHiddenChunk, h1 = std::min(hidden, end * kHiddenChunk);
        if (p.dw.strides[1] == 1 || p.dw.strides[0] != 1) {  // dW's rows contiguous (or neither way)
          const ConstMatrix x_t{p.x.data, p.x.dtype, hidden, batch, p.x.strides[1], p.x.strides[0]};
          const ConstMatrix dlogits{dz, strip_dtype, batch, rows, 1, padded_batch};
          const MutableMatrix c{p.dw.At(0, v0), p.dw.dtype, hidden, rows, p.dw.strides[0], p.dw.strides[1]};
          GemmRegion(gemm, x_t, dlogits, c, h0, h1, 0, rows, blocking);
        } else {  // dW is the transposed view of [V, H] storage (nn.Linear's): write dWᵀ's rows
          const ConstMatrix dlogits_t{dz, strip_dtype, rows, batch, padded_batch, 1};
          const ConstMatrix x{p.x.data, p.x.dtype, batch, hidden, p.x.strides[0], p.x.strides[1]};
          const MutableMatrix c{p.dw.At(0, v0), p.dw.dtype, rows, hidden, p.dw.strides[1], p.dw.strides[0]};
          GemmRegion(gemm, dlogits_t, x, c, 0, rows, h0, h1, blocking);
        }
      });
    }
    if (want_dx && !dx_in_place) {
      ParallelFor(0, batch, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          DispatchDType(p.dx.dtype, [&](auto tag) {
            using T = decltype(tag);
            T* dst = static_cast<T*>(p.dx.data) + r * p.dx.strides[0];
            const Acc* src = dx_acc + r * hidden;
            if constexpr (std::is_same_v<T, double>) {
              for (int64_t h = 0; h < hidden; ++h) dst[h * p.dx.strides[1]] = src[h];
            } else {
              for (int64_t h = 0; h < hidden; ++h) StoreFromFloat(dst + h * p.dx.strides[1], static_cast<float>(src[h]));
            }
            return 0;
          });
        }
      });
    }
    return Status::Ok();
  }
};

template <typename Run>
Status Dispatch(const LinearCrossEntropyParams& p, const LinearCrossEntropyConfig& config,
                const LinearCrossEntropyConfig& grad_config, const Run& run) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  status = grad_config.Validate();
  if (!status.ok()) return status;
  status = CheckViews(p);
  if (!status.ok()) return status;
  Isa isa;
  status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  if (p.x.dtype == DType::kFloat64) return run(Kernel<double>(p, config, grad_config, isa));
  return run(Kernel<float>(p, config, grad_config, isa));
}

}  // namespace

int64_t LinearCrossEntropyFoldRows(const LinearCrossEntropyConfig& config, int64_t vocab) {
  const int64_t fit = kFoldBlockBytes / (4 * std::max<int64_t>(vocab, 1)) / kColumns * kColumns;
  return std::clamp<int64_t>(fit, kColumns, config.row_block);
}

bool LinearCrossEntropyFolds(DType dtype, Isa isa) {
  if (dtype == DType::kFloat32 || dtype == DType::kFloat64) return true;
  return isa != Isa::kAmx;
}

void LinearCrossEntropyScale(const void* src, DType src_dtype, double g, void* dst, DType dst_dtype, int64_t count) {
  ParallelFor(0, count, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    if (src_dtype == DType::kFloat64) {  // float64 gradients: double in, double out
      const double* s = static_cast<const double*>(src);
      double* d = static_cast<double*>(dst);
      for (int64_t i = begin; i < end; ++i) d[i] = g * s[i];
      return;
    }
    const float* s = static_cast<const float*>(src);
    const float gf = static_cast<float>(g);
    DispatchDType(dst_dtype, [&](auto tag) {
      using T = decltype(tag);
      T* d = static_cast<T*>(dst);
      for (int64_t i = begin; i < end; ++i) StoreFromFloat(d + i, gf * s[i]);
      return 0;
    });
  });
}

Status LinearCrossEntropy(const LinearCrossEntropyParams& params, const LinearCrossEntropyConfig& config,
                          const LinearCrossEntropyConfig* gradient_config) {
  if (params.dx.data != nullptr || params.dw.data != nullptr) {
    if (params.reduction == LossReduction::kNone) {
      return Status::Error(std::string(kOp) + ": the folded gradient needs reduction sum or mean, got none");
    }
    const DType acc = params.x.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
    for (const MutableStridedView<2>* g : {&params.dx, &params.dw}) {
      if (g->data != nullptr && g->dtype != acc) {
        return Status::Error(std::string(kOp) + ": the folded gradients must be " + DTypeName(acc) + ", got " +
                             DTypeName(g->dtype));
      }
    }
  }
  return Dispatch(params, config, gradient_config != nullptr ? *gradient_config : config, [](const auto& kernel) { return kernel.Forward(); });
}

Status LinearCrossEntropyBackward(const LinearCrossEntropyParams& params, const LinearCrossEntropyConfig& config) {
  return Dispatch(params, config, config, [](const auto& kernel) { return kernel.Backward(); });
}

}  // namespace tokamax
