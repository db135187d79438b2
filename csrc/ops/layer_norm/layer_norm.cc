// The layer_norm CPU kernels: blocks of block_rows rows in parallel, each row by one task
// through the tier's row loops (layer_norm_kernels_tiered.cc); float64 rows run the plain loops
// here. The backward's dscale/doffset: each block sums its rows in order into its own fp32
// partial row, then every column adds the blocks' partials in block order.
#include "csrc/ops/layer_norm/layer_norm.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "csrc/core/base/int_math.h"
#include "csrc/core/base/streaming.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/core/vec/tiers.h"

namespace tokamax {

TOKAMAX_DECLARE_IN_TIERS(const LayerNormKernels& LayerNormKernelTable();)

// The avx512bf16 and amx tiers add nothing to these loops: they run the avx512 one.
const LayerNormKernels& GetLayerNormKernels(Isa isa) {
  TOKAMAX_RETURN_BY_VECTOR_WIDTH(isa, LayerNormKernelTable());
}

int64_t LayerNormRowOffset(const LayerNormRows& t, int rank, int64_t row) {
  int64_t offset = 0;
  for (int d = rank - 2; d >= 0; --d) {
    const int64_t size = t.sizes[d];
    offset += (row % size) * t.strides[d];
    row /= size;
  }
  return offset;
}

namespace {

const char* RowPointer(const LayerNormRows& t, int rank, int64_t row) {
  return static_cast<const char*>(t.data) + LayerNormRowOffset(t, rank, row) * DTypeSize(t.dtype);
}

// A [cols] vector (scale or offset, any stride) in `Acc`, plus `add`; empty when absent.
template <typename Acc>
std::vector<Acc> Widen(const StridedView<1>& v, int64_t cols, double add) {
  std::vector<Acc> out;
  if (v.data == nullptr) return out;
  out.resize(cols);
  DispatchDType(v.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(v.data);
    for (int64_t j = 0; j < cols; ++j) {
      const T* e = p + j * v.strides[0];
      if constexpr (std::is_same_v<T, double>) {
        out[j] = static_cast<Acc>(*e + add);
      } else {
        out[j] = static_cast<Acc>(LoadAsFloat(e)) + static_cast<Acc>(add);
      }
    }
    return 0;
  });
  return out;
}

template <typename Acc>
const Acc* DataOrNull(const std::vector<Acc>& v) { return v.empty() ? nullptr : v.data(); }

// Calls block(b, first_row, last_row) for every block of block_rows rows, in parallel.
template <typename Block>
void ForEachBlock(int64_t rows, const LayerNormConfig& config, const Block& block) {
  ParallelFor(0, CeilDiv(rows, config.block_rows), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      block(b, b * config.block_rows, std::min((b + 1) * config.block_rows, rows));
    }
  });
}

// float64 rows: the same math in double, plain loops (gradcheck, never a hot path).
void ForwardRowDouble(const double* x, const double* res, double* h, double* y, int64_t cols, const double* w,
                      const double* b, double eps, bool subtract_mean, double* mean_out, double* rstd_out) {
  if (res != nullptr) {
    for (int64_t j = 0; j < cols; ++j) h[j] = x[j] + res[j];
    x = h;
  }
  double mean = 0, var = 0;
  if (subtract_mean && cols > 0) {
    for (int64_t j = 0; j < cols; ++j) mean += x[j];
    mean /= cols;
  }
  for (int64_t j = 0; j < cols; ++j) var += (x[j] - mean) * (x[j] - mean);
  if (cols > 0) var /= cols;
  const double rstd = 1 / std::sqrt(var + eps);
  for (int64_t j = 0; j < cols; ++j) y[j] = (x[j] - mean) * rstd * (w ? w[j] : 1.0) + (b ? b[j] : 0.0);
  *mean_out = mean;
  *rstd_out = rstd;
}

void BackwardRowDouble(const double* x, const double* dy, const double* dh, double* dx, double* dres, int64_t cols,
                       const double* w, double mean, double rstd, bool subtract_mean, double* dscale, double* doffset) {
  double sum_g = 0, sum_gx = 0;
  for (int64_t j = 0; j < cols; ++j) {
    const double xhat = (x[j] - mean) * rstd, g = dy[j] * (w ? w[j] : 1.0);
    sum_g += g;
    sum_gx += g * xhat;
    if (dscale) dscale[j] += dy[j] * xhat;
    if (doffset) doffset[j] += dy[j];
  }
  const double mg = subtract_mean ? sum_g / cols : 0.0, mgx = sum_gx / cols;
  for (int64_t j = 0; j < cols; ++j) {
    const double xhat = (x[j] - mean) * rstd, g = dy[j] * (w ? w[j] : 1.0);
    const double out = rstd * (g - mg - xhat * mgx) + (dh ? dh[j] : 0.0);
    dx[j] = out;
    if (dres) dres[j] = out;
  }
}

// Stores fp32/fp64 column sums into `out` of `dtype`.
template <typename Acc>
void StoreColumns(const Acc* sums, int64_t cols, DType dtype, void* out) {
  DispatchDType(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(out);
    for (int64_t j = 0; j < cols; ++j) {
      if constexpr (std::is_same_v<T, double>) p[j] = sums[j]; else StoreFromFloat(p + j, static_cast<float>(sums[j]));
    }
    return 0;
  });
}

}  // namespace

Status LayerNorm(const LayerNormParams& p, const LayerNormConfig& config) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  const int64_t cols = p.cols;
  const int64_t esize = DTypeSize(p.x.dtype);
  if (p.x.dtype == DType::kFloat64) {
    const std::vector<double> w = Widen<double>(p.scale, cols, p.scale_offset), b = Widen<double>(p.offset, cols, 0.0);
    ForEachBlock(p.rows, config, [&](int64_t, int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        ForwardRowDouble(reinterpret_cast<const double*>(RowPointer(p.x, p.rank, r)),
                         p.residual.data ? reinterpret_cast<const double*>(RowPointer(p.residual, p.rank, r)) : nullptr,
                         p.h ? static_cast<double*>(p.h) + r * cols : nullptr, static_cast<double*>(p.y) + r * cols,
                         cols, DataOrNull(w), DataOrNull(b), p.epsilon, p.subtract_mean,
                         static_cast<double*>(p.mean) + r, static_cast<double*>(p.rstd) + r);
      }
    });
    return Status::Ok();
  }
  Isa isa;
  status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  const LayerNormKernels& kernels = GetLayerNormKernels(isa);
  const std::vector<float> w = Widen<float>(p.scale, cols, p.scale_offset), b = Widen<float>(p.offset, cols, 0.0);
  // y past the caches when it cannot stay in them anyway (then a store need not first read the
  // line it overwrites: a third of the forward's memory traffic).
  const bool stream_y = p.rows * cols * esize >= kStreamOutputBytes;
  ForEachBlock(p.rows, config, [&](int64_t, int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      LayerNormNextRow next;
      if (r + 1 < last) {
        next.inputs[0] = RowPointer(p.x, p.rank, r + 1);
        if (p.residual.data) next.inputs[1] = RowPointer(p.residual, p.rank, r + 1);
      }
      kernels.forward_row(p.x.dtype, RowPointer(p.x, p.rank, r),
                          p.residual.data ? RowPointer(p.residual, p.rank, r) : nullptr,
                          p.h ? static_cast<char*>(p.h) + r * cols * esize : nullptr,
                          static_cast<char*>(p.y) + r * cols * esize, stream_y, cols, DataOrNull(w), DataOrNull(b),
                          static_cast<float>(p.epsilon), p.subtract_mean, static_cast<float*>(p.mean) + r,
                          static_cast<float*>(p.rstd) + r, next);
    }
    if (stream_y) kernels.stream_fence();
  });
  return Status::Ok();
}

Status LayerNormBackward(const LayerNormParams& p, const LayerNormConfig& config) {
  Status status = config.Validate();
  if (!status.ok()) return status;
  const int64_t rows = p.rows, cols = p.cols;
  const int64_t esize = DTypeSize(p.x.dtype);
  const int64_t blocks = CeilDiv(rows, config.block_rows);
  const bool want_dscale = p.dscale != nullptr, want_doffset = p.doffset != nullptr;
  // Per-block partial rows: [blocks][cols] for dscale, then for doffset.
  const int64_t partial_rows = (want_dscale ? 1 : 0) + (want_doffset ? 1 : 0);
  const bool is_double = p.x.dtype == DType::kFloat64;
  const int64_t acc_size = is_double ? 8 : 4;
  LargeBuffer<char> partials(std::max<int64_t>(blocks * partial_rows * cols * acc_size, 1), LargeBuffer<char>::kUninitialized);
  auto partial = [&](int64_t block, int which) {  // which: 0 dscale, 1 doffset
    const int64_t index = which == 0 || !want_dscale ? 0 : 1;
    return partials.data() + ((block * partial_rows + index) * cols) * acc_size;
  };
  if (cols == 0) return Status::Ok();
  if (is_double) {
    const std::vector<double> w = Widen<double>(p.scale, cols, p.scale_offset);
    ForEachBlock(rows, config, [&](int64_t blk, int64_t first, int64_t last) {
      double* ds = want_dscale ? reinterpret_cast<double*>(partial(blk, 0)) : nullptr;
      double* db = want_doffset ? reinterpret_cast<double*>(partial(blk, 1)) : nullptr;
      if (ds) std::fill(ds, ds + cols, 0.0);
      if (db) std::fill(db, db + cols, 0.0);
      for (int64_t r = first; r < last; ++r) {
        BackwardRowDouble(reinterpret_cast<const double*>(RowPointer(p.x, p.rank, r)),
                          reinterpret_cast<const double*>(RowPointer(p.dy, p.rank, r)),
                          p.dh.data ? reinterpret_cast<const double*>(RowPointer(p.dh, p.rank, r)) : nullptr,
                          static_cast<double*>(p.y) + r * cols, p.h ? static_cast<double*>(p.h) + r * cols : nullptr,
                          cols, DataOrNull(w), static_cast<const double*>(p.mean)[r],
                          static_cast<const double*>(p.rstd)[r], p.subtract_mean, ds, db);
      }
    });
  } else {
    Isa isa;
    status = ActiveIsa(&isa);
    if (!status.ok()) return status;
    const LayerNormKernels& kernels = GetLayerNormKernels(isa);
    const std::vector<float> w = Widen<float>(p.scale, cols, p.scale_offset);
    const bool stream_dx = rows * cols * esize >= kStreamOutputBytes;
    ForEachBlock(rows, config, [&](int64_t blk, int64_t first, int64_t last) {
      float* ds = want_dscale ? reinterpret_cast<float*>(partial(blk, 0)) : nullptr;
      float* db = want_doffset ? reinterpret_cast<float*>(partial(blk, 1)) : nullptr;
      if (ds) std::fill(ds, ds + cols, 0.0f);
      if (db) std::fill(db, db + cols, 0.0f);
      for (int64_t r = first; r < last; ++r) {
        LayerNormNextRow next;
        if (r + 1 < last) {
          next.inputs[0] = RowPointer(p.x, p.rank, r + 1);
          next.inputs[1] = RowPointer(p.dy, p.rank, r + 1);
          if (p.dh.data) next.inputs[2] = RowPointer(p.dh, p.rank, r + 1);
        }
        kernels.backward_row(p.x.dtype, RowPointer(p.x, p.rank, r), RowPointer(p.dy, p.rank, r),
                             p.dh.data ? RowPointer(p.dh, p.rank, r) : nullptr,
                             static_cast<char*>(p.y) + r * cols * esize,
                             p.h ? static_cast<char*>(p.h) + r * cols * esize : nullptr, stream_dx, cols,
                             DataOrNull(w), static_cast<const float*>(p.mean)[r],
                             static_cast<const float*>(p.rstd)[r], p.subtract_mean, ds, db, next);
      }
      if (stream_dx) kernels.stream_fence();
    });
  }
  // Each column adds the blocks' partials in block order: bits independent of the threads.
  constexpr int64_t kColumnChunk = 256;
  for (int which = 0; which < 2; ++which) {
    void* out = which == 0 ? p.dscale : p.doffset;
    if (out == nullptr) continue;
    const DType out_dtype = which == 0 ? p.scale.dtype : p.offset.dtype;
    ParallelFor(0, CeilDiv(cols, kColumnChunk), 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t c0 = c * kColumnChunk, n = std::min(kColumnChunk, cols - c0);
        const int64_t out_size = DTypeSize(out_dtype);
        auto reduce = [&](auto zero) {
          using Acc = decltype(zero);
          Acc sums[kColumnChunk] = {};
          for (int64_t blk = 0; blk < blocks; ++blk) {
            const Acc* part = reinterpret_cast<const Acc*>(partial(blk, which)) + c0;
            for (int64_t j = 0; j < n; ++j) sums[j] += part[j];
          }
          StoreColumns(sums, n, out_dtype, static_cast<char*>(out) + c0 * out_size);
        };
        if (is_double) reduce(0.0); else reduce(0.0f);
      }
    });
  }
  return Status::Ok();
}

void LayerNormReference(const std::vector<double>& x, int64_t rows, int64_t cols, const std::vector<double>& w,
                        const std::vector<double>& b, double epsilon, bool subtract_mean, std::vector<double>* y,
                        std::vector<double>* mean, std::vector<double>* rstd) {
  y->assign(rows * cols, 0.0);
  mean->assign(rows, 0.0);
  rstd->assign(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    ForwardRowDouble(x.data() + r * cols, nullptr, nullptr, y->data() + r * cols, cols, w.empty() ? nullptr : w.data(),
                     b.empty() ? nullptr : b.data(), epsilon, subtract_mean, mean->data() + r, rstd->data() + r);
  }
}

}  // namespace tokamax
