// fused_moe / fused_experts configs: heuristics and the autotuning space (one field list, two ops).
#include <algorithm>
#include <set>

#include "csrc/core/base/int_math.h"
#include "csrc/ops/fused_moe/fused_moe.h"

namespace tokamax {
namespace {

static_assert(ConfigFieldNamed<FusedExpertsConfig>("task_rows").multiple_of == kGemmMr, "task_rows: whole tiles");
static_assert(ConfigFieldNamed<FusedExpertsConfig>("block_n").multiple_of == kGemmNr, "block_n: whole panels");

// A task takes all of one expert's rows up to task_rows and packs each of its weight panels
// once for them: an expert's rows up to twice the mean fit in one task (routing is uneven),
// rounded up to whole 6-row tiles. The cap bounds a task's fp32 accumulator (rows x block_n,
// 2 MiB at 1020 x 512).
constexpr int64_t kMaxTaskRows = 1020;
// The GEMM core's measured best on Xeon (ragged_dot's heuristic): 256-deep slices, 512-wide blocks.
constexpr int64_t kDefaultBlockK = 256;
constexpr int64_t kDefaultBlockN = 512;

FusedExpertsConfig Heuristic(const FusedExpertsShape& call, DType dtype, const CpuInfo& cpu) {
  FusedExpertsConfig config;
  const int64_t rows_per_expert = CeilDiv(std::max<int64_t>(call.tokens * call.topk, 1),
                                          std::max<int64_t>(call.experts, 1));
  config.task_rows = std::clamp<int64_t>(RoundUp(2 * rows_per_expert, kGemmMr), kGemmMr, kMaxTaskRows);
  config.block_k = kDefaultBlockK;
  config.block_n = kDefaultBlockN;
  // As ragged_dot (fp32, T=512 E=64 top-6 forward, ~48 rows an expert: 425 -> 307 ms in place).
  config.pack_b_min_rows = kGemmPackBMinRows;
  // Decode: 16-bit weights read in place, widened in the fp32 micro-kernel (bf16 tasks under one
  // 16-row tile where a bf16 engine exists), take the GEMM core's streaming blocking
  // (amd_zen5_avx512bf16, T=4 E=60 top-4 H=2048 I=1408, bf16 forward: 9.2 -> 6.1 ms, 46 GB/s of
  // weights; T=32: 31.3 -> 24.7 ms). fp32 keeps 256 x 512: 32-deep slices measured 15.0 ->
  // 16.6 ms there (bandwidth-bound either way). Transposed views are packed: they keep it too.
  const bool sixteen_bit = dtype == DType::kBFloat16 || dtype == DType::kFloat16;
  if (call.weights_in_place && sixteen_bit && config.task_rows < config.pack_b_min_rows &&
      InPlaceProductWidens(config.task_rows, dtype, cpu)) {
    const StreamingBlocking streaming = InPlaceBlocking(config.task_rows, dtype, cpu);
    config.block_k = streaming.block_k;
    config.block_n = streaming.block_n;
  }
  return config;
}

std::vector<FusedExpertsConfig> Space(const FusedExpertsShape& call, DType dtype, const CpuInfo& cpu) {
  const FusedExpertsConfig heuristic = Heuristic(call, dtype, cpu);
  std::vector<FusedExpertsConfig> space{heuristic};
  std::set<std::vector<int64_t>> seen{heuristic.ToVector()};
  for (int64_t task_rows : {heuristic.task_rows, int64_t{96}, int64_t{384}, int64_t{1020}}) {
    for (int64_t block_k : {int64_t{256}, int64_t{512}, int64_t{128}}) {
      for (int64_t block_n : {int64_t{512}, int64_t{256}}) {
        FusedExpertsConfig config;
        config.task_rows = task_rows;
        config.block_k = block_k;
        config.block_n = block_n;
        config.pack_b_min_rows = heuristic.pack_b_min_rows;
        if (config.Validate().ok() && seen.insert(config.ToVector()).second) space.push_back(config);
      }
    }
  }
  // Always packed, or in place up to the cap on task_rows, at the heuristic's blocking.
  for (int64_t pack_b_min_rows : {int64_t{0}, kMaxTaskRows + 1}) {
    FusedExpertsConfig config = heuristic;
    config.pack_b_min_rows = pack_b_min_rows;
    if (seen.insert(config.ToVector()).second) space.push_back(config);
  }
  return space;
}

template <typename To, typename From>
To Convert(const From& from) {
  To to;
  To::FromVector(from.ToVector(), &to);
  return to;
}

}  // namespace

Status FusedExpertsConfig::ValidateCrossFields() const { return Status::Ok(); }
Status FusedMoeConfig::ValidateCrossFields() const { return Status::Ok(); }

FusedExpertsConfig ToExpertsConfig(const FusedMoeConfig& config) { return Convert<FusedExpertsConfig>(config); }

// Both products share the blocking: the backward's products have the forward's operands.
FusedExpertsConfig FusedExpertsHeuristicConfig(const FusedExpertsShape& call, DType dtype, const CpuInfo& cpu,
                                               FusedExpertsProduct) {
  return Heuristic(call, dtype, cpu);
}

std::vector<FusedExpertsConfig> FusedExpertsConfigSpace(const FusedExpertsShape& call, DType dtype,
                                                        const CpuInfo& cpu, FusedExpertsProduct) {
  return Space(call, dtype, cpu);
}

FusedMoeConfig FusedMoeHeuristicConfig(const FusedExpertsShape& call, DType dtype, const CpuInfo& cpu,
                                       FusedMoeProduct) {
  return Convert<FusedMoeConfig>(Heuristic(call, dtype, cpu));
}

std::vector<FusedMoeConfig> FusedMoeConfigSpace(const FusedExpertsShape& call, DType dtype, const CpuInfo& cpu,
                                                FusedMoeProduct) {
  std::vector<FusedMoeConfig> space;
  for (const FusedExpertsConfig& config : Space(call, dtype, cpu)) space.push_back(Convert<FusedMoeConfig>(config));
  return space;
}

}  // namespace tokamax
