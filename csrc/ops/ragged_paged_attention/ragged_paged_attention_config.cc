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
  RaggedPagedAttentionConfig config;
  const int64_t group = shape.kv_heads > 0 ? std::max<int64_t>(1, shape.q_heads / shape.kv_heads) : 1;
  // 32 keys: a tile's V rows, asked for during its K pass, are still in L2 when the V pass reads
  // them (32 x 8 heads x 512 B = 128 KiB fp32). Measured on the decode benchmark (B = 32, 1k-8k
  // tokens, 2 threads, Intel AMX machine): fp32 60 / 61 / 71 / 81 ms at 32 / 64 / 128 / 256 keys,
  // bf16 35 ms from 16 to 128 keys, 38 ms at 256.
  config.block_kv = 32;
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
    config.split_kv = std::max(RoundUp(CeilDiv(max_keys, splits), config.block_kv), 16 * config.block_kv);
  }
  // From 32 query tokens (128 rows at group 4) the GEMM's packed tiles (AMX for bf16) beat the row
  // products, whose fp32 multiply-adds run ~185 GFLOP/s on 2 cores against the GEMM's ~250 fp32
  // and ~600 bf16 (benchmarks/ragged_paged_attention.py, docs/benchmarks.md); the gather of the
  // sequence's pages costs one read of its cache.
  config.gemm_min_tokens = 32;
  // Tasks whose passes wait on memory stage their tiles (stops the stride prefetchers running past
  // scattered pages; docs/benchmarks.md). The products' work per byte of K/V is rows / element
  // size: staging gained at up to 2 rows a byte (Zen 5, 16-token pages, staged / in place: 4 rows
  // bf16 1.32x, 8 rows fp32 1.06-1.20x), was even at 4 (8 rows bf16 0.96-1.01x) and cost 5-17% at
  // 16 rows, where the products bound. Zen 5 (AMD family 0x1a) and later only: on Zen 4 the same
  // decode batches ran 1.15-1.54x slower staged (bf16 page 16 24.7 -> 36.9 ms, fp32 page 128
  // 52.2 -> 60.4), and Intel was measured in place only.
  const bool stage = cpu.vendor == "amd" && cpu.family >= 0x1a;
  config.stage_rows = stage ? 2 * DTypeSize(dtype) : 0;
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
  for (int64_t block_kv : {16, 32, 128}) {
    for (int64_t split_kv : {int64_t{0}, heuristic.split_kv, int64_t{512}}) {
      for (int64_t task_rows : {int64_t{32}, heuristic.task_rows}) {
        for (int64_t gemm_min_tokens : {heuristic.gemm_min_tokens, int64_t{0}}) {
          for (int64_t stage_rows : {heuristic.stage_rows, int64_t{0}}) {
            RaggedPagedAttentionConfig config = heuristic;
            config.block_kv = block_kv;
            config.split_kv = split_kv;
            config.task_rows = task_rows;
            config.gemm_min_tokens = gemm_min_tokens;
            config.stage_rows = stage_rows;
            if (!config.Validate().ok() || !seen.insert(config.ToVector()).second) continue;
            space.push_back(config);
          }
        }
      }
    }
  }
  return space;
}

}  // namespace tokamax
