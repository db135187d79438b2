// moe_permute (a StableCountingSort of the ids) and ragged_gather_reduce's CPU kernels.
#include "csrc/ops/moe_gather/moe_gather.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "csrc/core/runtime/isa.h"
#include "csrc/core/vec/tiers.h"
#include "csrc/ops/moe_gather/counting_sort.h"
#include "csrc/ops/moe_gather/element_access.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/parallel.h"

namespace tokamax {

Status MoePermute(const MoePermuteParams& p) {
  const IndexMatrix& ids = p.expert_indices;
  const int64_t n = ids.rows * ids.cols, experts = p.num_experts;
  if (experts < 1 || experts > std::numeric_limits<int32_t>::max()) {
    return Status::Error("moe_permute: num_experts must be in [1, 2^31), got " + std::to_string(experts));
  }
  if (n > std::numeric_limits<int32_t>::max()) {
    return Status::Error("moe_permute: T*k must be below 2^31 (group_sizes are int32), got " + std::to_string(n));
  }
  auto id_at = [&](int64_t i) { return ids.At(i / ids.cols, i % ids.cols); };
  LargeBuffer<int64_t> starts(experts + 1, LargeBuffer<int64_t>::kUninitialized);
  const int64_t bad = StableCountingSort(n, experts, id_at, p.order, p.inverse, &starts[0]);
  if (bad >= 0) {
    return Status::Error("moe_permute: expert_indices[" + std::to_string(bad / ids.cols) + ", " +
                         std::to_string(bad % ids.cols) + "] must be in [0, num_experts=" + std::to_string(experts) +
                         "), got " + std::to_string(id_at(bad)));
  }
  for (int64_t e = 0; e < experts; ++e) p.group_sizes[e] = static_cast<int32_t>(starts[e + 1] - starts[e]);
  return Status::Ok();
}

}  // namespace tokamax

// ---- ragged_gather_reduce ------------------------------------------------------------------------

namespace tokamax {

TOKAMAX_DECLARE_IN_TIERS(GatherSumRowsFn GatherSumRows(DType dtype);)

namespace {

GatherSumRowsFn SumRowsOf(Isa isa, DType dtype) {
  TOKAMAX_RETURN_BY_VECTOR_WIDTH(isa, GatherSumRows(dtype));
}

// The active tier's row sum (the avx512bf16 and amx tiers run avx512's) into *sum_rows; null for
// float64. An error only for an unknown TOKAMAX_CPU_ISA, before anything is written.
Status ActiveSumRows(DType dtype, GatherSumRowsFn* sum_rows) {
  Isa isa;
  const Status status = ActiveIsa(&isa);
  if (!status.ok()) return status;
  *sum_rows = SumRowsOf(isa, dtype);
  return Status::Ok();
}

// A run of row sums on the tier's SumRows, each call prefetching the next one's rows: item i's
// rows and weights come from collect(i, rows, weights), which returns their count.
template <typename Collect, typename OutAt>
void SumRowRuns(GatherSumRowsFn sum_rows, int64_t begin, int64_t end, int64_t limit, int64_t max_rows,
                int64_t width, const Collect& collect, const OutAt& out_at) {
  std::vector<const void*> rows(max_rows), next(max_rows);
  std::vector<float> weights(max_rows), next_weights(max_rows);
  int64_t count = collect(begin, rows.data(), weights.data());
  for (int64_t i = begin; i < end; ++i) {
    const int64_t next_count = i + 1 < limit ? collect(i + 1, next.data(), next_weights.data()) : 0;
    sum_rows(rows.data(), weights.data(), count, next.data(), next_count, out_at(i), width);
    std::swap(rows, next);
    std::swap(weights, next_weights);
    count = next_count;
  }
}

// Columns per accumulator tile: 2 KiB of fp32 (4 KiB fp64) on the stack, in L1 with the rows.
constexpr int64_t kColumnTile = 512;

using moe::Acc;
using moe::Load;
using moe::LoadAny;
using moe::Store;
using moe::StoreAny;

// acc[h] (=|+=) w * row[h * stride], h < width. The unit-stride loops are separate so the
// compiler vectorizes them (the widening of bf16/fp16 included).
template <typename T, typename A>
void Axpy(A* acc, const T* row, int64_t stride, int64_t width, A w, bool assign) {
  if (stride == 1) {
    if (assign) {
      for (int64_t h = 0; h < width; ++h) acc[h] = w * Load(row + h);
    } else {
      for (int64_t h = 0; h < width; ++h) acc[h] += w * Load(row + h);
    }
    return;
  }
  if (assign) {
    for (int64_t h = 0; h < width; ++h) acc[h] = w * Load(row + h * stride);
  } else {
    for (int64_t h = 0; h < width; ++h) acc[h] += w * Load(row + h * stride);
  }
}

// sum over h < n of a[h * sa] * b[h * sb]. Unit strides: 8 interleaved partial sums (lane h % 8),
// added pairwise at the end: a fixed order the compiler can vectorize.
template <typename T, typename A = Acc<T>>
A Dot(const T* a, int64_t sa, const T* b, int64_t sb, int64_t n) {
  if (sa != 1 || sb != 1) {
    A dot = 0;
    for (int64_t h = 0; h < n; ++h) dot += Load(a + h * sa) * Load(b + h * sb);
    return dot;
  }
  constexpr int kLanes = 8;
  A part[kLanes] = {};
  int64_t h = 0;
  for (; h + kLanes <= n; h += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += Load(a + h + l) * Load(b + h + l);
  }
  for (int l = 0; h < n; ++h, ++l) part[l] += Load(a + h) * Load(b + h);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Whether row j of the gather takes part: the mask, then the range rule.
bool Selected(const RaggedGatherReduceParams& p, int64_t j) {
  if (p.valid != nullptr && !p.valid[j * p.valid_stride]) return false;
  if (p.range == RowRange::kPosition) return p.start <= j && j < p.end;
  if (p.range == RowRange::kIndex) {
    const int64_t index = p.indices[j];
    return p.start <= index && index < p.end;
  }
  return true;
}

// Group size, divisibility, the range bounds and the indices of selected rows, before any write.
Status CheckGatherReduce(const RaggedGatherReduceParams& p) {
  const std::string op = p.op;
  const int64_t n = p.indices.count, rows = p.x.sizes[0];
  if (p.group_size < 1 || n % p.group_size != 0) {
    return Status::Error(op + ": reduce_group_size must be >= 1 and divide N=" + std::to_string(n) + ", got " +
                         std::to_string(p.group_size));
  }
  if (p.range != RowRange::kNone) {
    const bool by_index = p.range == RowRange::kIndex;
    const int64_t limit = by_index ? rows : n;
    if (p.start < 0 || p.start > p.end || p.end > limit) {
      return Status::Error(op + ": start and end must satisfy 0 <= start <= end <= " + (by_index ? "R=" : "N=") +
                           std::to_string(limit) + ", got start=" + std::to_string(p.start) +
                           ", end=" + std::to_string(p.end));
    }
    if (by_index) return Status::Ok();  // a selected index lies in [start, end), within [0, R)
  }
  for (int64_t j = 0; j < n; ++j) {
    if (!Selected(p, j)) continue;
    const int64_t index = p.indices[j];
    if (index < 0 || index >= rows) {
      return Status::Error(op + ": indices[" + std::to_string(j) + "] must be in [0, R=" + std::to_string(rows) +
                           ") (a row of x) " +
                           (p.range == RowRange::kPosition ? "for start <= j < end" : "where valid_rows_mask is set") +
                           ", got " + std::to_string(index));
    }
  }
  return Status::Ok();
}

double WeightAt(const RaggedGatherReduceParams& p, int64_t j) {
  return p.topk_weights.data == nullptr ? 1.0 : LoadAny(p.topk_weights.At(j), p.topk_weights.dtype);
}

// Rows per parallel task: about 16K elements of work, enough to pay for a task.
int64_t Grain(int64_t work_per_item) {
  return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, work_per_item));
}

}  // namespace

Status RaggedGatherReduce(const RaggedGatherReduceParams& p) {
  const Status status = CheckGatherReduce(p);
  if (!status.ok()) return status;
  const int64_t g = p.group_size, hidden = p.x.sizes[1], tokens = p.indices.count / g;
  if (g == 1 && p.topk_weights.data == nullptr && p.x.strides[1] == 1 && p.out.strides[1] == 1) {
    // A plain row gather (ragged_gather, ragged_scatter): rows copied whole, bits unchanged.
    const size_t row_bytes = static_cast<size_t>(hidden * DTypeSize(p.x.dtype));
    ParallelFor(0, tokens, Grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        void* out = p.out.At(t, 0);
        if (Selected(p, t)) {
          std::memcpy(out, p.x.At(p.indices[t], 0), row_bytes);
        } else {
          std::memset(out, 0, row_bytes);
        }
      }
    });
    return Status::Ok();
  }
  GatherSumRowsFn sum_rows = nullptr;
  const Status isa_status = ActiveSumRows(p.x.dtype, &sum_rows);
  if (!isa_status.ok()) return isa_status;
  if (sum_rows != nullptr && p.x.strides[1] == 1 && p.out.strides[1] == 1) {
    ParallelFor(0, tokens, Grain(g * hidden), [&](int64_t begin, int64_t end) {
      auto collect = [&](int64_t t, const void** rows, float* weights) {
        int64_t count = 0;
        for (int64_t j = t * g; j < (t + 1) * g; ++j) {
          if (!Selected(p, j)) continue;
          rows[count] = p.x.At(p.indices[j], 0);
          weights[count++] = static_cast<float>(WeightAt(p, j));
        }
        return count;
      };
      SumRowRuns(sum_rows, begin, end, tokens, g, hidden, collect, [&](int64_t t) { return p.out.At(t, 0); });
    });
    return Status::Ok();
  }
  return DispatchDType(p.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    ParallelFor(0, tokens, Grain(g * hidden), [&](int64_t begin, int64_t end) {
      A acc[kColumnTile];
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t c0 = 0; c0 < hidden; c0 += kColumnTile) {
          const int64_t width = std::min(kColumnTile, hidden - c0);
          // The first selected row initialises the sum (w * x, not 0 + w * x): a gather with
          // weight 1 then copies x exactly, -0.0 included.
          bool first = true;
          for (int64_t j = t * g; j < (t + 1) * g; ++j) {
            if (!Selected(p, j)) continue;
            const A w = static_cast<A>(WeightAt(p, j));
            Axpy(acc, static_cast<const T*>(p.x.At(p.indices[j], c0)), p.x.strides[1], width, w, first);
            first = false;
          }
          if (first) std::fill(acc, acc + width, A(0));
          T* out = static_cast<T*>(p.out.At(t, c0));
          for (int64_t h = 0; h < width; ++h) Store(out + h * p.out.strides[1], acc[h]);
        }
      }
    });
    return Status::Ok();
  });
}

Status RaggedGatherReduceBackward(const RaggedGatherReduceParams& p) {
  const Status status = CheckGatherReduce(p);
  if (!status.ok()) return status;
  const int64_t g = p.group_size, hidden = p.x.sizes[1], rows = p.x.sizes[0], n = p.indices.count;
  // dx by destination row: the valid j sorted by their row (stable, so j ascending within a row;
  // the rest in a last bucket, `rows`), then each row summed by the one task that owns it. No
  // atomics, and the order of each sum is fixed.
  LargeBuffer<int64_t> order(n, LargeBuffer<int64_t>::kUninitialized);
  LargeBuffer<int64_t> starts(rows + 2, LargeBuffer<int64_t>::kUninitialized);
  StableCountingSort(
      n, rows + 1, [&](int64_t j) { return Selected(p, j) ? p.indices[j] : rows; }, &order[0], nullptr,
      &starts[0]);
  const int64_t per_row = std::max<int64_t>(1, n / std::max<int64_t>(1, rows)) * hidden;
  GatherSumRowsFn sum_rows = nullptr;
  const Status isa_status = ActiveSumRows(p.x.dtype, &sum_rows);
  if (!isa_status.ok()) return isa_status;
  const bool tiered_dx = sum_rows != nullptr && p.dout.strides[1] == 1 && p.dx.strides[1] == 1;
  if (tiered_dx) {
    int64_t max_rows = 0;  // the most j gathering one row
    for (int64_t r = 0; r < rows; ++r) max_rows = std::max(max_rows, starts[r + 1] - starts[r]);
    ParallelFor(0, rows, Grain(per_row), [&](int64_t begin, int64_t end) {
      auto collect = [&](int64_t r, const void** sources, float* weights) {
        int64_t count = 0;
        for (int64_t i = starts[r]; i < starts[r + 1]; ++i) {
          const int64_t j = order[i];
          sources[count] = p.dout.At(j / g, 0);
          weights[count++] = static_cast<float>(WeightAt(p, j));
        }
        return count;
      };
      SumRowRuns(sum_rows, begin, end, rows, max_rows, hidden, collect, [&](int64_t r) { return p.dx.At(r, 0); });
    });
  }
  return DispatchDType(p.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    if (!tiered_dx) {
      ParallelFor(0, rows, Grain(per_row), [&](int64_t begin, int64_t end) {
        A acc[kColumnTile];
        for (int64_t r = begin; r < end; ++r) {
          for (int64_t c0 = 0; c0 < hidden; c0 += kColumnTile) {
            const int64_t width = std::min(kColumnTile, hidden - c0);
            std::fill(acc, acc + width, A(0));
            for (int64_t i = starts[r]; i < starts[r + 1]; ++i) {
              const int64_t j = order[i];
              const A w = static_cast<A>(WeightAt(p, j));
              Axpy(acc, static_cast<const T*>(p.dout.At(j / g, c0)), p.dout.strides[1], width, w, false);
            }
            T* dx = static_cast<T*>(p.dx.At(r, c0));
            for (int64_t h = 0; h < width; ++h) Store(dx + h * p.dx.strides[1], acc[h]);
          }
        }
      });
    }
    if (p.dtopk_weights.data == nullptr) return Status::Ok();
    ParallelFor(0, n, Grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        A dot = 0;
        if (Selected(p, j)) {
          dot = Dot(static_cast<const T*>(p.dout.At(j / g, 0)), p.dout.strides[1],
                    static_cast<const T*>(p.x.At(p.indices[j], 0)), p.x.strides[1], hidden);
        }
        StoreAny(p.dtopk_weights.At(j), p.dtopk_weights.dtype, dot);
      }
    });
    return Status::Ok();
  });
}

}  // namespace tokamax
