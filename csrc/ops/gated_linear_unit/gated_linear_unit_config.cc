// gated_linear_unit configs: validation, heuristics and the autotuning space.
#include <algorithm>
#include <cstdint>
#include <set>
#include <string>

#include "csrc/core/base/int_math.h"
#include "csrc/ops/gated_linear_unit/gated_linear_unit.h"

namespace tokamax {
namespace {

constexpr const ConfigField& kBlockMField = ConfigFieldNamed<GatedLinearUnitConfig>("block_m");
constexpr const ConfigField& kBlockNField = ConfigFieldNamed<GatedLinearUnitConfig>("block_n");
constexpr int64_t kMaxTaskM = ConfigFieldNamed<GatedLinearUnitConfig>("task_m").max;
static_assert(kBlockMField.multiple_of == kGemmMr && kBlockMField.min == kGemmMr, "block_m: whole micro-tiles");
static_assert(kBlockNField.multiple_of == kGemmNr && kBlockNField.min == kGemmNr, "block_n: whole panels");
// Per-thread scratch (thread-local, grow-only): a task's fp32 accumulator and one packed B
// slice, each at most 64 MiB. The forward packs gate and up: 2 * block_n columns, each half
// rounded up to the widest tier's 32-column group.
constexpr int64_t kMaxScratchBytes = int64_t{64} << 20;
constexpr int64_t kWidestGroup = 32;
// Enough tasks for load balance on a few cores, each big enough to amortise packing its B block.
constexpr int64_t kTargetTasks = 16;
constexpr int64_t kMinTaskRows = 1152;

int64_t PackedColumns(int64_t block_n) { return 2 * RoundUp(block_n, kWidestGroup); }

// The GEMM a product runs: its rows, output columns and whether it is the gated forward. The
// backward's config serves dx [M, K] and dweights [K, 2N]; it is chosen for the larger.
struct ProductGemm {
  int64_t rows, cols;
  bool gated;
  bool b_in_place;  // the forward's weights read in place when its rows are few
};

ProductGemm GemmOf(const GatedLinearUnitShape& call, GatedLinearUnitProduct product) {
  if (product == GatedLinearUnitProduct::kForward) return {call.m, call.n, true, call.weights_in_place};
  return call.m * call.k >= call.k * 2 * call.n ? ProductGemm{call.m, call.k, false, false}
                                                : ProductGemm{call.k, 2 * call.n, false, false};
}

GatedLinearUnitConfig HeuristicOfGemm(const ProductGemm& gemm, DType dtype, const CpuInfo& cpu) {
  GatedLinearUnitConfig config;
  // block_k: a 32-wide fp32 B panel of block_k rows beside the A panel in L1 (ragged_dot's choice).
  config.block_k = cpu.l1d_bytes >= 32 * 1024 ? 256 : 128;
  // block_m: the packed A block (block_m x block_k fp32) about a quarter of L2; multiples of 48
  // suit the 6-, 12- and 16-row tiles (avx2, avx512, the bf16 engine).
  const int64_t rows = std::max<int64_t>(gemm.rows, 1);
  const int64_t l2_rows = (cpu.l2_bytes / 4) / (config.block_k * 4) / 48 * 48;
  config.block_m = std::min(std::max<int64_t>(std::min<int64_t>(l2_rows, 144), 48), RoundUp(rows, kGemmMr));
  // block_n: the gated forward packs 256 columns of gate and 256 of up (512, as ragged_dot; at
  // M=4096, K=2048, N=5632 128 to 512 measured within 3%). The backward's plain products use
  // 1024: A is repacked once per column block, and dweights' A is xᵀ, a transpose to pack (bf16
  // dweights at M=1024: 33 ms against 50 ms with 512).
  const int64_t max_n = RoundUp(std::max<int64_t>(gemm.cols, 1), kGemmNr);
  config.block_n = std::min<int64_t>(gemm.gated ? 256 : 1024, max_n);
  // A forward of few rows reads contiguous weights in place (kGemmPackBMinRows): the GEMM core's
  // streaming blocking (decode, M=1-4 K=2048 N=5632 bf16, amd_zen5_avx512bf16: 1.84-1.88 ->
  // 1.01-1.11 ms, eager 1.6-1.8 ms). Transposed views are packed, where 32-deep slices read
  // each weight row 64 bytes at a time (bf16 M=1-12: 2.6 -> 5.5-6.2 ms): they keep 256. bf16
  // rows from one 16-row tile run on the dot engine, which packs B (M=32: 3.8 -> 4.0 ms).
  if (gemm.gated && gemm.b_in_place && rows < kGemmPackBMinRows && InPlaceProductWidens(rows, dtype, cpu)) {
    const StreamingBlocking streaming = InPlaceBlocking(rows, dtype, cpu);
    config.block_k = streaming.block_k;
    config.block_n = std::min(streaming.block_n, max_n);
  }
  // task_m: each task packs its own B block over the whole depth, so tasks keep at least
  // kMinTaskRows rows where the rows allow (M=4096 dx, fp32: 1440-row tasks 700 ms, 576-row
  // ones 790 ms); up to that, rows are split until there are kTargetTasks tasks, and always
  // enough that the fp32 accumulator (task_m x packed columns) stays within 8 MiB. The row
  // tasks are even, so none is a sliver.
  const int64_t column_blocks = CeilDiv(std::max<int64_t>(gemm.cols, 1), config.block_n);
  const int64_t packed = gemm.gated ? PackedColumns(config.block_n) : config.block_n;
  const int64_t max_task_m =
      std::max(config.block_m, std::min((int64_t{8} << 20) / (packed * 4), kMaxTaskM) / config.block_m * config.block_m);
  const int64_t min_task_m = std::min<int64_t>(rows, kMinTaskRows);
  int64_t row_tasks = 1;
  while (column_blocks * row_tasks < kTargetTasks && CeilDiv(rows, row_tasks + 1) >= min_task_m) ++row_tasks;
  row_tasks = std::max(row_tasks, CeilDiv(rows, max_task_m));
  config.task_m = std::min(max_task_m, RoundUp(CeilDiv(rows, row_tasks), config.block_m));
  return config;
}

}  // namespace

Status GatedLinearUnitConfig::ValidateCrossFields() const {
  if (task_m < block_m || task_m % block_m != 0) {
    return ConfigError(kOpName, "task_m", "a multiple of block_m (" + std::to_string(block_m) + ") in [block_m, " +
                                              std::to_string(kMaxTaskM) + "]",
                       task_m);
  }
  if (task_m * PackedColumns(block_n) * 4 > kMaxScratchBytes) {
    return ConfigError(kOpName, "task_m * 2 * block_n * 4", "at most 64 MiB (accumulator)",
                       task_m * PackedColumns(block_n) * 4);
  }
  if (block_k * PackedColumns(block_n) * 4 > kMaxScratchBytes) {
    return ConfigError(kOpName, "block_k * 2 * block_n * 4", "at most 64 MiB (packed B)",
                       block_k * PackedColumns(block_n) * 4);
  }
  return Status::Ok();
}

GatedLinearUnitConfig GatedLinearUnitHeuristicConfig(const GatedLinearUnitShape& call, DType dtype,
                                                     const CpuInfo& cpu, GatedLinearUnitProduct product) {
  return HeuristicOfGemm(GemmOf(call, product), dtype, cpu);
}

std::vector<GatedLinearUnitConfig> GatedLinearUnitConfigSpace(const GatedLinearUnitShape& call, DType dtype,
                                                              const CpuInfo& cpu, GatedLinearUnitProduct product) {
  const ProductGemm gemm = GemmOf(call, product);
  const GatedLinearUnitConfig heuristic = GatedLinearUnitHeuristicConfig(call, dtype, cpu, product);
  std::vector<GatedLinearUnitConfig> space = {heuristic};
  std::set<std::vector<int64_t>> seen = {heuristic.ToVector()};
  const int64_t rows = std::max<int64_t>(gemm.rows, 1);
  const int64_t max_n = RoundUp(std::max<int64_t>(gemm.cols, 1), kGemmNr);
  for (int64_t block_m : {48, 144}) {
    const int64_t bm = std::min(block_m, RoundUp(rows, kGemmMr));
    for (int64_t block_k : {128, 256}) {
      for (int64_t block_n : {256, 512, 1024}) {
        GatedLinearUnitConfig config;
        config.block_m = bm;
        config.block_k = block_k;
        config.block_n = std::min(block_n, max_n);
        config.task_m = std::max(bm, RoundUp(heuristic.task_m, bm));
        if (!config.Validate().ok() || !seen.insert(config.ToVector()).second) continue;
        space.push_back(config);
      }
    }
  }
  return space;
}

}  // namespace tokamax
