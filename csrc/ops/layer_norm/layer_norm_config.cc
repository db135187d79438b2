// layer_norm configs: the heuristic and the autotuning space (one field, block_rows).
#include <algorithm>
#include <set>

#include "csrc/core/base/int_math.h"
#include "csrc/ops/layer_norm/layer_norm.h"

namespace tokamax {
namespace {

constexpr int64_t kMaxBlockRows = ConfigFieldNamed<LayerNormConfig>("block_rows").max;
// At least ~16K elements per task pays for a task (a few microseconds of work), and at most
// ~256 blocks keeps the backward's partial rows (blocks x cols fp32, written and read once) at a
// few percent of its traffic: 2% at [8192, 4096], where 256 tasks still balance 16+ threads.
constexpr int64_t kTaskElements = 16384;
constexpr int64_t kMaxBlocks = 256;

}  // namespace

Status LayerNormConfig::ValidateCrossFields() const { return Status::Ok(); }  // one field

LayerNormConfig LayerNormHeuristicConfig(const LayerNormShape& call, DType dtype, const CpuInfo& cpu,
                                         LayerNormProduct product) {
  (void)dtype, (void)cpu, (void)product;  // both products walk the rows the same way
  LayerNormConfig config;
  const int64_t by_size = CeilDiv(kTaskElements, std::max<int64_t>(call.cols, 1));
  const int64_t by_count = CeilDiv(std::max<int64_t>(call.rows, 1), kMaxBlocks);
  config.block_rows = std::clamp<int64_t>(std::max(by_size, by_count), 1, kMaxBlockRows);
  return config;
}

std::vector<LayerNormConfig> LayerNormConfigSpace(const LayerNormShape& call, DType dtype, const CpuInfo& cpu,
                                                  LayerNormProduct product) {
  const LayerNormConfig heuristic = LayerNormHeuristicConfig(call, dtype, cpu, product);
  std::vector<LayerNormConfig> space = {heuristic};
  std::set<std::vector<int64_t>> seen = {heuristic.ToVector()};
  for (int64_t rows : {heuristic.block_rows / 4, heuristic.block_rows / 2, heuristic.block_rows * 2,
                       heuristic.block_rows * 4, int64_t{1}}) {
    LayerNormConfig config;
    config.block_rows = rows;
    if (config.Validate().ok() && seen.insert(config.ToVector()).second) space.push_back(config);
  }
  return space;
}

}  // namespace tokamax
