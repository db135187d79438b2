// ragged_paged_attention configs: the cross-field rule, the heuristic and the autotuning space.
#include <algorithm>
#include <set>

#include "csrc/core/base/int_math.h"
#include "csrc/ops/ragged_paged_attention/ragged_paged_attention.h"

namespace tokamax {
namespace {

// Enough (sequence, split) tasks that a few cores stay busy to the end of a decode batch whose
// lengths differ (tasks run longest first).
constexpr int64_t kTargetTasks = 32;

}  // namespace

Status RaggedPagedAttentionConfig::ValidateCrossFields() const {
  // Splits start on tile boundaries, so a split's tiles are whole tiles of the unsplit walk.
  if (split_kv % block_kv != 0) {
    return ConfigError(kOpName, "split_kv", "a multiple of block_kv = " + std::to_string(block_kv), split_kv);
  }
  return Status::Ok();
}

RaggedPagedAttentionConfig RaggedPagedAttentionHeuristicConfig(const RaggedPagedAttentionShape& shape, DType dtype,
                                                               const CpuInfo& cpu, RaggedPagedAttentionProduct) {
  (void)dtype;
  RaggedPagedAttentionConfig config;
  const int64_t group = shape.kv_heads > 0 ? std::max<int64_t>(1, shape.q_heads / shape.kv_heads) : 1;
  // 128 keys: a decode task's logits tile (128 x Hq fp32) stays in L1 and a tile's K and V rows
  // of all 8 kv heads (128 x 8 x 128 x 2 B x 2 = 512 KiB bf16) in L2 between the K and V passes.
  config.block_kv = cpu.l2_bytes >= (1 << 20) ? 128 : 64;
  // A prefill task holds 32 tokens of one kv head's group: 128 rows of fp32 q and acc (64 KiB at
  // D = 128) against the streamed K/V tile; a decode task (1 token) every kv head of its sequence.
  config.q_tile_tokens = 32;
  config.task_rows = std::max<int64_t>(128, group);
  // Decode batches of fewer sequences than kTargetTasks: split each sequence's keys.
  const int64_t max_keys = shape.pages_per_seq * shape.page_size;
  const int64_t seqs = std::max<int64_t>(shape.num_seqs, 1);
  config.split_kv = 0;
  if (seqs < kTargetTasks && max_keys > 0) {
    const int64_t splits = CeilDiv(kTargetTasks, seqs);
    config.split_kv = std::max(RoundUp(CeilDiv(max_keys, splits), config.block_kv), 4 * config.block_kv);
  }
  // From 32 query tokens (128 rows at group 4) the GEMM's packed tiles (AMX for bf16) beat the row
  // products, whose fp32 multiply-adds run ~185 GFLOP/s on 2 cores against the GEMM's ~250 fp32
  // and ~600 bf16 (benchmarks/ragged_paged_attention.py, docs/benchmarks.md); the gather of the
  // sequence's pages costs one read of its cache.
  config.gemm_min_tokens = 32;
  config.split_kv = std::min<int64_t>(config.split_kv, ConfigFieldNamed<RaggedPagedAttentionConfig>("split_kv").max /
                                                           config.block_kv * config.block_kv);
  return config;
}

std::vector<RaggedPagedAttentionConfig> RaggedPagedAttentionConfigSpace(const RaggedPagedAttentionShape& shape,
                                                                        DType dtype, const CpuInfo& cpu,
                                                                        RaggedPagedAttentionProduct product) {
  const RaggedPagedAttentionConfig heuristic = RaggedPagedAttentionHeuristicConfig(shape, dtype, cpu, product);
  std::vector<RaggedPagedAttentionConfig> space = {heuristic};
  std::set<std::vector<int64_t>> seen = {heuristic.ToVector()};
  for (int64_t block_kv : {32, 128, 256}) {
    for (int64_t split_kv : {int64_t{0}, heuristic.split_kv, int64_t{512}}) {
      for (int64_t task_rows : {int64_t{32}, heuristic.task_rows}) {
        for (int64_t gemm_min_tokens : {heuristic.gemm_min_tokens, int64_t{0}}) {
          RaggedPagedAttentionConfig config = heuristic;
          config.block_kv = block_kv;
          config.split_kv = split_kv;
          config.task_rows = task_rows;
          config.gemm_min_tokens = gemm_min_tokens;
          if (!config.Validate().ok() || !seen.insert(config.ToVector()).second) continue;
          space.push_back(config);
        }
      }
    }
  }
  return space;
}

}  // namespace tokamax
