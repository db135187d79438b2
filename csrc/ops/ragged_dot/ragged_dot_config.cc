// ragged_dot configs: validation, (de)serialisation, heuristics and the autotuning space.
#include <algorithm>
#include <cstdint>
#include <set>
#include <string>

#include "csrc/core/gemm/gemm.h"
#include "csrc/core/base/int_math.h"
#include "csrc/ops/ragged_dot/ragged_dot.h"

namespace tokamax {
namespace {

// The field list's steps are the GEMM micro-tile's: block_m whole 6-row tiles, block_n whole
// 16-column panels.
constexpr const ConfigField& kBlockMField = ConfigFieldNamed<RaggedDotConfig>("block_m");
constexpr const ConfigField& kBlockNField = ConfigFieldNamed<RaggedDotConfig>("block_n");
constexpr int64_t kMaxTaskM = ConfigFieldNamed<RaggedDotConfig>("task_m").max;
static_assert(kBlockMField.multiple_of == kGemmMr && kBlockMField.min == kGemmMr, "block_m: whole micro-tiles");
static_assert(kBlockNField.multiple_of == kGemmNr && kBlockNField.min == kGemmNr, "block_n: whole panels");
// Per-thread scratch the kernel keeps (grow-only, thread-local): the fp32 accumulator of a task,
// one packed B slice and one packed A block, each at most 64 MiB.
constexpr int64_t kMaxScratchBytes = int64_t{64} << 20;
// Enough tasks for load balance on a few cores, while each task stays big enough to amortise
// packing its B block.
constexpr int64_t kTargetTasks = 16;

// Rows of the per-group GEMM and its output width, by form.
int64_t GemmRowsPerGroup(const RaggedDotShape& shape) {
  if (shape.form == RaggedDotForm::kRaggedContracting) return shape.k;
  return CeilDiv(std::max<int64_t>(shape.m, 1), std::max<int64_t>(shape.g, 1));
}

}  // namespace

const char* RaggedDotFormName(RaggedDotForm form) {
  switch (form) {
    case RaggedDotForm::kDefault: return "DEFAULT";
    case RaggedDotForm::kTransRhs: return "TRANS_RHS";
    case RaggedDotForm::kRaggedContracting: return "RAGGED_CONTRACTING";
  }
  return "unknown";
}

std::vector<int64_t> RaggedDotDimensionNumbers(RaggedDotForm form) {
  switch (form) {
    case RaggedDotForm::kDefault: return {1, 1, 0, 0, 1, 1, 1, 1, 0, 0};
    case RaggedDotForm::kTransRhs: return {1, 1, 0, 0, 1, 1, 1, 2, 0, 0};
    case RaggedDotForm::kRaggedContracting: return {1, 1, 0, 0, 1, 0, 0, 0, 0};
  }
  return {};
}

Status ParseRaggedDotDimensionNumbers(const std::vector<int64_t>& flat, RaggedDotForm* form) {
  for (RaggedDotForm candidate : {RaggedDotForm::kDefault, RaggedDotForm::kTransRhs,
                                  RaggedDotForm::kRaggedContracting}) {
    if (flat == RaggedDotDimensionNumbers(candidate)) {
      *form = candidate;
      return Status::Ok();
    }
  }
  std::string got = "(";
  for (size_t i = 0; i < flat.size(); ++i) got += (i ? "," : "") + std::to_string(flat[i]);
  got += ")";
  return Status::Error(
      "ragged_dot: ragged_dot_dimension_numbers must be one of DEFAULT (1,1,0,0,1,1,1,1,0,0), "
      "TRANS_RHS (1,1,0,0,1,1,1,2,0,0) or RAGGED_CONTRACTING (1,1,0,0,1,0,0,0,0), got " + got);
}

Status RaggedDotConfig::ValidateCrossFields() const {
  if (task_m < block_m || task_m % block_m != 0) {
    return ConfigError(kOpName, "task_m", "a multiple of block_m (" + std::to_string(block_m) + ") in [block_m, " +
                                              std::to_string(kMaxTaskM) + "]",
                       task_m);
  }
  if (task_m * block_n * 4 > kMaxScratchBytes) {
    return ConfigError(kOpName, "task_m * block_n * 4", "at most 64 MiB (accumulator)", task_m * block_n * 4);
  }
  if (block_k * block_n * 4 > kMaxScratchBytes) {
    return ConfigError(kOpName, "block_k * block_n * 4", "at most 64 MiB (packed B)", block_k * block_n * 4);
  }
  return Status::Ok();
}

RaggedDotShape RaggedDotProductShape(const RaggedDotShape& call, RaggedDotProduct product) {
  // A call (m, k, n, g) is lhs[M,K] with output width n. Each gradient is itself a ragged_dot:
  //   DEFAULT   dlhs = TRANS_RHS(dout[M,N], rhs[G,K,N]) -> [M,K]; drhs = RAGGED_C.(lhs, dout) -> [G,K,N]
  //   TRANS_RHS dlhs = DEFAULT(dout[M,N], rhs[G,N,K]) -> [M,K];   drhs = RAGGED_C.(dout, lhs) -> [G,N,K]
  //   RAGGED_C. dlhs = TRANS_RHS(rhs[M,N], dout[G,K,N]) -> [M,K]; drhs = DEFAULT(lhs, dout) -> [M,N]
  if (product == RaggedDotProduct::kForward) return call;
  const int64_t m = call.m, k = call.k, n = call.n, g = call.g;
  const bool dlhs = product == RaggedDotProduct::kDlhs;
  switch (call.form) {
    case RaggedDotForm::kDefault:
      return dlhs ? RaggedDotShape{RaggedDotForm::kTransRhs, m, n, k, g}
                  : RaggedDotShape{RaggedDotForm::kRaggedContracting, m, k, n, g};
    case RaggedDotForm::kTransRhs:
      return dlhs ? RaggedDotShape{RaggedDotForm::kDefault, m, n, k, g}
                  : RaggedDotShape{RaggedDotForm::kRaggedContracting, m, n, k, g};
    case RaggedDotForm::kRaggedContracting:
      return dlhs ? RaggedDotShape{RaggedDotForm::kTransRhs, m, n, k, g}
                  : RaggedDotShape{RaggedDotForm::kDefault, m, k, n, g};
  }
  return call;
}

namespace {

// The heuristic config of a forward call with this shape.
RaggedDotConfig HeuristicOfShape(const RaggedDotShape& shape, DType dtype, const CpuInfo& cpu) {
  // B is widened to fp32 while packing, so the blocking is dtype-independent, except where B
  // is read in place (InPlaceBlocking).
  RaggedDotConfig config;
  // block_k: a 16-wide fp32 B micro-panel of block_k rows must sit in L1 beside the A panel:
  // 256 * 16 * 4 B = 16 KiB of Zen 3's 32 KiB.
  config.block_k = cpu.l1d_bytes >= 32 * 1024 ? 256 : 128;
  // block_m: the packed A block (block_m x block_k fp32) takes about a quarter of L2:
  // 144 * 256 * 4 B = 144 KiB of 512 KiB. Groups smaller than that pack only their rows.
  const int64_t rows = std::max<int64_t>(GemmRowsPerGroup(shape), 1);
  const int64_t l2_rows = (cpu.l2_bytes / 4) / (config.block_k * 4) / kGemmMr * kGemmMr;
  // Multiples of 12 suit both the 6-row (avx2) and the 12-row (avx512) tiles.
  config.block_m = std::min(std::max<int64_t>(std::min<int64_t>(l2_rows, 144), kGemmMr),
                            RoundUp(rows, rows >= 2 * kGemmMr ? 2 * kGemmMr : kGemmMr));
  config.pack_b_min_rows = kGemmPackBMinRows;
  // TRANS_RHS reads rhs[g]ᵀ, whose columns are strided: B is always packed there. In place,
  // the GEMM core's streaming blocking; packed, 512-wide blocks amortise packing A over more
  // micro-panels (N = 1024 gives two column blocks per group).
  const bool in_place = rows < config.pack_b_min_rows && shape.form != RaggedDotForm::kTransRhs;
  const int64_t max_n = RoundUp(std::max<int64_t>(shape.n, 1), kGemmNr);
  config.block_n = std::min<int64_t>(512, max_n);
  if (in_place) {
    const StreamingBlocking streaming = InPlaceBlocking(rows, dtype, cpu);
    config.block_k = streaming.block_k;
    config.block_n = std::min(streaming.block_n, max_n);
  }
  // task_m: a whole group per task when that already gives kTargetTasks tasks, else halve.
  // E.g. M=8192, G=8, N=1024: 1024-row groups x 2 column blocks = 16 tasks of 1152 rows.
  const int64_t column_blocks = CeilDiv(std::max<int64_t>(shape.n, 1), config.block_n);
  const int64_t groups = std::max<int64_t>(
      shape.form == RaggedDotForm::kRaggedContracting ? shape.g : std::min(shape.g, shape.m), 1);
  int64_t task_m = RoundUp(rows, config.block_m);
  while (task_m > config.block_m && groups * column_blocks * CeilDiv(rows, task_m) < kTargetTasks) {
    task_m = RoundUp(task_m / 2, config.block_m);
  }
  // A bf16 engine packs B into VNNI panels once per task, a pass bound by reading B from
  // memory, so a big group cut into block_m-row tasks reads its B once per task. Where the groups
  // alone give enough tasks, tasks of at least 144 rows: only groups larger than the average
  // (skewed sizes) are cut fewer times (intel_model167_amx, bf16 forward, 128 Zipf groups, 2
  // threads: amx 11.4-11.6 -> 9.8-10.1 ms, avx512bf16 31.5-32.1 -> 25.6-26.4 ms; issue 22).
  // Sharing one packed B among a group's tasks instead measured no faster (each task still
  // reads 1 MiB of packed panels from memory).
  const bool bf16_engine = dtype == DType::kBFloat16 && cpu.avx512bf16;
  if (bf16_engine && groups * column_blocks >= kTargetTasks) {
    task_m = std::max(task_m, RoundUp(144, config.block_m));
  }
  // Cap the per-thread fp32 accumulator (task_m x block_n) at 8 MiB.
  const int64_t max_task_m =
      std::min((int64_t{8} << 20) / (config.block_n * 4), kMaxTaskM) / config.block_m * config.block_m;
  config.task_m = std::max(config.block_m, std::min(task_m, max_task_m));
  return config;
}

}  // namespace

RaggedDotConfig RaggedDotHeuristicConfig(const RaggedDotShape& call, DType dtype, const CpuInfo& cpu,
                                         RaggedDotProduct product) {
  return HeuristicOfShape(RaggedDotProductShape(call, product), dtype, cpu);
}

std::vector<RaggedDotConfig> RaggedDotConfigSpace(const RaggedDotShape& call, DType dtype, const CpuInfo& cpu,
                                                  RaggedDotProduct product) {
  const RaggedDotShape shape = RaggedDotProductShape(call, product);
  const RaggedDotConfig heuristic = HeuristicOfShape(shape, dtype, cpu);
  std::vector<RaggedDotConfig> space = {heuristic};
  std::set<std::vector<int64_t>> seen = {heuristic.ToVector()};
  const int64_t rows = std::max<int64_t>(GemmRowsPerGroup(shape), 1);
  const int64_t max_n = RoundUp(std::max<int64_t>(shape.n, 1), kGemmNr);
  for (int64_t block_m : {72, 144}) {
    const int64_t bm = std::min(block_m, RoundUp(rows, kGemmMr));
    for (int64_t block_k : {32, 128, 256}) {
      for (int64_t block_n : {256, 512, 1024}) {
        const int64_t bn = std::min(block_n, max_n);
        for (int64_t pack_b_min_rows : {0, 12, 96}) {
          RaggedDotConfig config;
          config.block_m = bm;
          config.block_k = block_k;
          config.block_n = bn;
          config.task_m = std::max(bm, RoundUp(heuristic.task_m, bm));
          config.pack_b_min_rows = pack_b_min_rows;
          if (!config.Validate().ok() || !seen.insert(config.ToVector()).second) continue;
          space.push_back(config);
        }
      }
    }
  }
  return space;
}

Status CheckRaggedDotGroupSizes(const int64_t* group_sizes, int64_t num_groups, int64_t rows) {
  __int128 total = 0;  // wide enough that no int64 group sizes can overflow it
  for (int64_t g = 0; g < num_groups; ++g) {
    if (group_sizes[g] < 0) {
      return Status::Error("ragged_dot: group_sizes must be non-negative, got group_sizes[" +
                           std::to_string(g) + "] = " + std::to_string(group_sizes[g]));
    }
    total += group_sizes[g];
  }
  if (total > rows) {
    const std::string got = total > INT64_MAX ? std::string("more than 2^63") :
                                                std::to_string(static_cast<int64_t>(total));
    return Status::Error("ragged_dot: sum(group_sizes) must be at most the number of rows of lhs (" +
                         std::to_string(rows) + "), got " + got);
  }
  return Status::Ok();
}

}  // namespace tokamax
