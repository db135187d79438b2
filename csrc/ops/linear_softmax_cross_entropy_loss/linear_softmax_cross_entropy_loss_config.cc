// linear_softmax_cross_entropy_loss configs: the heuristic and the autotuning space.
#include <algorithm>
#include <set>
#include <string>

#include "csrc/core/base/int_math.h"
#include "csrc/ops/linear_softmax_cross_entropy_loss/linear_softmax_cross_entropy_loss.h"

namespace tokamax {
namespace {

// A task's fp32 logits tile (vocab_block x row_block) stays at most 8 MiB.
constexpr int64_t kMaxTileBytes = int64_t{8} << 20;

LinearCrossEntropyConfig Make(int64_t row_block, int64_t vocab_block, int64_t block_k) {
  LinearCrossEntropyConfig config;
  config.row_block = row_block;
  config.vocab_block = vocab_block;
  config.block_k = block_k;
  return config;
}

}  // namespace

Status LinearCrossEntropyConfig::ValidateCrossFields() const {
  if (row_block * vocab_block * 4 > kMaxTileBytes) {
    return ConfigError(kOpName, "row_block * vocab_block * 4", "at most 8 MiB (a task's fp32 logits tile)",
                       row_block * vocab_block * 4);
  }
  return Status::Ok();
}

LinearCrossEntropyConfig LinearCrossEntropyHeuristicConfig(const LinearCrossEntropyShape& call, DType dtype,
                                                           const CpuInfo& cpu, LinearCrossEntropyProduct product) {
  (void)dtype, (void)product;  // both passes tile the logits the same way
  // row_block: every task packs the whole of W once per row block (twice in the backward), and
  // with the bf16 engine that packing costs as much as a product of ~100 rows: blocks are as
  // tall as still gives 4 tasks, at most 512 rows (the GEMM's column block). Measured on the
  // amx tier, bf16 [512, 1024] x [1024, 32064] forward+backward: 64-row blocks 450-560, 128-row
  // 770-800, 256-row 840-880 GFLOP/s.
  const int64_t batch = std::max<int64_t>(call.batch, 1);
  const int64_t row_block = std::clamp<int64_t>(RoundUp(CeilDiv(batch, 4), 16), 16, 512);
  // vocab_block: each tile repacks its block of x, so tiles are deep: the fp32 tile
  // (vocab_block x row_block) fills L2 (1024 rows for 512-row blocks in 2 MiB). Measured on the
  // amx tier, fp32 [4096, 2048] x [2048, 8000], 512-row blocks: 512-deep tiles 186, 1024-deep
  // 201, 2048-deep 202 GFLOP/s useful forward+backward (bf16: within noise).
  const int64_t l2_rows = cpu.l2_bytes / (4 * row_block) / 16 * 16;
  const int64_t vocab_block =
      std::min<int64_t>(std::clamp<int64_t>(l2_rows, 256, 1024), RoundUp(std::max<int64_t>(call.vocab, 1), 16));
  // block_k: a 16-wide fp32 B panel of block_k rows beside the A panel in a 32+ KiB L1.
  const int64_t block_k = cpu.l1d_bytes >= 32 * 1024 ? 256 : 128;
  return Make(row_block, vocab_block, block_k);
}

std::vector<LinearCrossEntropyConfig> LinearCrossEntropyConfigSpace(const LinearCrossEntropyShape& call, DType dtype,
                                                                    const CpuInfo& cpu,
                                                                    LinearCrossEntropyProduct product) {
  const LinearCrossEntropyConfig heuristic = LinearCrossEntropyHeuristicConfig(call, dtype, cpu, product);
  std::vector<LinearCrossEntropyConfig> space = {heuristic};
  std::set<std::vector<int64_t>> seen = {heuristic.ToVector()};
  auto add = [&](int64_t rb, int64_t vb, int64_t bk) {
    const LinearCrossEntropyConfig config = Make(rb, vb, bk);
    if (config.Validate().ok() && seen.insert(config.ToVector()).second) space.push_back(config);
  };
  for (int64_t rb : {heuristic.row_block / 2, heuristic.row_block * 2, int64_t{16}}) {
    add(RoundUp(std::max<int64_t>(rb, 16), 16), heuristic.vocab_block, heuristic.block_k);
  }
  for (int64_t vb : {heuristic.vocab_block / 2, heuristic.vocab_block * 2, int64_t{64}}) {
    add(heuristic.row_block, RoundUp(std::max<int64_t>(vb, 16), 16), heuristic.block_k);
  }
  for (int64_t bk : {int64_t{64}, int64_t{128}, int64_t{512}}) add(heuristic.row_block, heuristic.vocab_block, bk);
  return space;
}

}  // namespace tokamax
