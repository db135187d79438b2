// dot_product_attention configs: validation, (de)serialisation, heuristics and the autotuning
// space.
#include <algorithm>
#include <cstdint>
#include <set>
#include <string>

#include "csrc/core/base/int_math.h"
#include "csrc/ops/dot_product_attention/attention_row_products.h"
#include "csrc/ops/dot_product_attention/dot_product_attention.h"

namespace tokamax {
namespace {

constexpr int64_t kMaxSplits = ConfigFieldNamed<DotProductAttentionConfig>("num_splits").max;
// The largest logits tile a config may ask for (block_q x block_kv fp32, before multiplying by
// the group size): 16 MiB. The kernel checks the tile with the group size folded in.
constexpr int64_t kMaxTileFloats = int64_t{1} << 22;
// Rows of a tile the heuristics aim for: 96 is a multiple of the 12-row (avx512) and 6-row
// (avx2) micro-tiles and of the 32-wide (avx512) and 16-wide (avx2) column panels; a 96-row
// fp32 Q block of head_dim 128 is 48 KiB, so Q stays in L1/L2 while K/V tiles stream past.
constexpr int64_t kTargetRows = 96;
// Enough independent tasks that a few cores stay busy to the end (decode splits its keys; the
// logsumexp merge of the splits costs ~1% at S=4096, N=32).
constexpr int64_t kTargetForwardTasks = 32;
constexpr int64_t kTargetBackwardTasks = 4;
// Key counts that split into whole fp32 micro-kernel panels on every tier (mr 6 and 12), and
// are multiples of 8 as configs must be.
constexpr int64_t kFp32KvMultiple = 24;
static_assert(kFp32KvMultiple % ConfigFieldNamed<DotProductAttentionConfig>("block_kv").multiple_of == 0,
              "rounded tiles must stay valid block_kv values");

// block_kv for the products of `dtype`. The fp32 micro-kernels (every dtype but bf16 widens to
// them) cut a kv tile into panels of mr keys: 128 keys are 10 2/3 panels, the last a third
// padding, 3% of four of the seven products, so fp32 tiles round down to a multiple of 24
// (128 -> 120, 256 -> 240; causal fp32 GQA 32/8 at T=S=2048 on Zen 4: forward+backward
// 643-685 against 654-707 ms). bf16 keeps its size: the bf16 engine's tiles are 16 keys, and
// 32 deep for Kᵀ·dS.
int64_t KvTileKeys(int64_t block_kv, DType dtype) {
  return dtype == DType::kBFloat16 ? block_kv : block_kv / kFp32KvMultiple * kFp32KvMultiple;
}

int64_t GroupOf(const DotProductAttentionShape& shape) {
  return shape.kv_heads > 0 ? std::max<int64_t>(shape.q_heads / shape.kv_heads, 1) : 1;
}

}  // namespace

Status DotProductAttentionConfig::ValidateCrossFields() const {
  if (block_q * block_kv > kMaxTileFloats) {
    return ConfigError(kOpName, "block_q * block_kv", "at most 2^22 (a 16 MiB logits tile)", block_q * block_kv);
  }
  return Status::Ok();
}

DotProductAttentionConfig DotProductAttentionHeuristicConfig(const DotProductAttentionShape& shape, DType dtype,
                                                             const CpuInfo& cpu, DotProductAttentionProduct product) {
  // The block sizes fit L2 for every dtype: the fp32 paths widen every operand while packing,
  // and the bf16 engine's tiles (avx512bf16, amx), half the bytes, fit wherever the fp32 ones do
  // (an A/B of block sizes on the amx paths stayed within the noise, docs/benchmarks.md). Only
  // block_kv's rounding depends on the dtype, below.
  DotProductAttentionConfig config;
  const int64_t group = GroupOf(shape);
  // A tile's rows are (position, query head) pairs: block_q positions times the group.
  config.block_q = std::max<int64_t>(1, kTargetRows / group);
  config.block_q = std::min(config.block_q, std::max<int64_t>(shape.q_len, 1));
  // block_kv: 256 keys keep the fp32 logits tile (256 x 96 = 96 KiB) and one packed K or V tile
  // (256 x 128 x 4 = 128 KiB) inside a 512 KiB L2. Block-sparse masks skip whole tiles, so
  // smaller tiles follow a diagonal or a segment boundary more closely.
  config.block_kv = shape.block_sparse ? 128 : 256;
  if (cpu.l2_bytes < 512 * 1024) config.block_kv = 128;
  const int64_t q_blocks = CeilDiv(std::max<int64_t>(shape.q_len, 1), config.block_q);
  // Decode-sized calls take the row path (no GEMM tiles): a single block of at most
  // kMaxRowDotRows rows.
  const bool row_path = q_blocks == 1 && config.block_q * group <= attention::kMaxRowDotRows;
  if (!row_path) config.block_kv = KvTileKeys(config.block_kv, dtype);
  const int64_t kv_blocks = CeilDiv(std::max<int64_t>(shape.kv_len, 1), config.block_kv);
  const int64_t heads = std::max<int64_t>(shape.batch * shape.kv_heads, 1);
  // num_splits depends on the shape alone (never the thread count), so results are the same
  // bits on any machine with the same ISA tier.
  if (product == DotProductAttentionProduct::kForward) {
    // Decode: too few (batch, kv head, q block) tasks to fill the cores: split the keys. The
    // row path's tasks hold every kv head of a batch.
    const int64_t tasks = (row_path ? std::max<int64_t>(shape.batch, 1) : heads) * q_blocks;
    if (tasks < kTargetForwardTasks) {
      config.num_splits = std::min(CeilDiv(kTargetForwardTasks, tasks), kv_blocks);
    }
  } else {
    const int64_t tasks = heads;
    if (tasks < kTargetBackwardTasks) {
      config.num_splits = std::min(CeilDiv(kTargetBackwardTasks, tasks), q_blocks);
    }
  }
  config.num_splits = std::max<int64_t>(1, std::min(config.num_splits, kMaxSplits));
  return config;
}

std::vector<DotProductAttentionConfig> DotProductAttentionConfigSpace(const DotProductAttentionShape& shape,
                                                                      DType dtype, const CpuInfo& cpu,
                                                                      DotProductAttentionProduct product) {
  const DotProductAttentionConfig heuristic = DotProductAttentionHeuristicConfig(shape, dtype, cpu, product);
  std::vector<DotProductAttentionConfig> space = {heuristic};
  std::set<std::vector<int64_t>> seen = {heuristic.ToVector()};
  const int64_t group = GroupOf(shape);
  const int64_t max_q = std::max<int64_t>(shape.q_len, 1);
  for (int64_t rows : {48, 96, 192}) {
    for (int64_t block_kv : {64, 128, 256, 512}) {
      for (int64_t split_factor : {1, 2}) {
        DotProductAttentionConfig config;
        config.block_q = std::min(std::max<int64_t>(1, rows / group), max_q);
        config.block_kv = KvTileKeys(block_kv, dtype);  // as the heuristic: 64 -> 48, 128 -> 120, ...
        config.num_splits = std::min(heuristic.num_splits * split_factor, kMaxSplits);
        if (!config.Validate().ok() || !seen.insert(config.ToVector()).second) continue;
        space.push_back(config);
      }
    }
  }
  return space;
}

Status CheckAttentionLengths(const int64_t* lengths, int64_t batch, int64_t max, const char* name) {
  for (int64_t b = 0; b < batch; ++b) {
    if (lengths[b] < 0 || lengths[b] > max) {
      return Status::Error(std::string("dot_product_attention: ") + name + " must lie in [0, " +
                           std::to_string(max) + "], got " + name + "[" + std::to_string(b) +
                           "] = " + std::to_string(lengths[b]));
    }
  }
  return Status::Ok();
}

}  // namespace tokamax
