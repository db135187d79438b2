// ragged_paged_attention (upstream batched_rpa): attention of T ragged query tokens of S sequences
// against a paged KV cache, after writing the tokens' own keys and values into it.
//
//   queries[T,Hq,D], keys/values[T,Hkv,D], kv_cache[P, page_size, 2*Hkv, D] (merged head 2h is K
//   of kv head h, 2h+1 its V: kv_cache_update's layout), kv_lens[S], page_indices[S*pages_per_seq],
//   cu_q_lens[S+1], distribution[3] = cumulative counts of decode, prefill and mixed sequences.
//
// Sequence s < distribution[2] owns tokens [cu_q_lens[s], cu_q_lens[s+1]); its cache holds
// kv_lens[s] positions, the last q_len of them its new tokens: token i sits at position
// kv_lens[s] - q_len + i, in page page_indices[s*pages_per_seq + pos / page_size]. Query head n
// reads kv head n / (Hq / Hkv). A token at position p sees key j < kv_lens[s] when j <= p (causal)
// and j > p - sliding_window (window). logits = sm_scale * q.k, then soft_cap * tanh(x / soft_cap),
// then masked logits become mask_value (or are dropped when it is absent). Tokens past
// cu_q_lens[distribution[2]] are padding: out 0, lse -inf, nothing written.
// Torch-free; the adapter checks shapes and dtypes, the core checks the index values.
#pragma once

#include <cstdint>
#include <vector>

#include "csrc/core/base/config_fields.h"
#include "csrc/core/base/dtype.h"
#include "csrc/core/base/status.h"
#include "csrc/core/base/strided_view.h"
#include "csrc/core/runtime/cpu_info.h"
#include "csrc/ops/kv_cache_update/kv_cache_update.h"

namespace tokamax {

// block_kv and split_kv change the bits (where the online softmax rescales; where a sequence's
// keys are cut into partial results), gemm_min_tokens too (which kernel a sequence runs);
// q_tile_tokens and task_rows only which rows share a task, stage_rows only where the rows are read.
#define TOKAMAX_RAGGED_PAGED_ATTENTION_CONFIG_FIELDS(X)                                                  \
  X(block_kv, 64, 8, 2048, 8, "keys per online-softmax tile, at multiples of block_kv positions")       \
  X(q_tile_tokens, 32, 1, 4096, 1, "query tokens of one sequence per task")                            \
  X(task_rows, 128, 1, 8192, 1, "query rows (tokens x query heads) per task at most: kv heads per task") \
  X(split_kv, 2048, 0, 1 << 24, 8,                                                                      \
    "keys per split of a sequence of one query tile (0: no split), merged in a fixed order")             \
  X(gemm_min_tokens, 32, 0, 1 << 30, 1,                                                                 \
    "sequences of at least this many query tokens (0: none) run dot_product_attention's GEMM kernel "    \
    "on their gathered pages")                                                                           \
  X(stage_rows, 4, 0, 8192, 1,                                                                          \
    "tasks of at most this many query rows per kv head (0: none) copy each tile's K/V rows into a "     \
    "contiguous scratch, in memory order, before reading them")
#define TOKAMAX_RAGGED_PAGED_ATTENTION_PRODUCTS(X) X(kForward, "forward")

struct RaggedPagedAttentionConfig {
  TOKAMAX_CONFIG_BODY(RaggedPagedAttentionConfig, "ragged_paged_attention",
                      TOKAMAX_RAGGED_PAGED_ATTENTION_CONFIG_FIELDS, TOKAMAX_RAGGED_PAGED_ATTENTION_PRODUCTS)
};
using RaggedPagedAttentionProduct = RaggedPagedAttentionConfig::Product;

// What heuristics and cache keys see: sizes only (the ragged lengths are values).
struct RaggedPagedAttentionShape {
  int64_t tokens = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t total_pages = 0;
  int64_t page_size = 0;
  int64_t num_seqs = 0;
  int64_t pages_per_seq = 0;
};

// The index arrays are KvCacheSlots views (int32 or int64, any stride).
struct RaggedPagedAttentionParams {
  StridedView<3> queries;          // [T, Hq, D], fp32/bf16/fp16
  StridedView<3> keys;             // [T, Hkv, D], kv_cache's dtype
  StridedView<3> values;           // [T, Hkv, D]
  MutableStridedView<4> kv_cache;  // [P, page_size, 2*Hkv, D], last dim stride 1
  KvCacheSlots kv_lens;            // [S]
  KvCacheSlots page_indices;       // [S * pages_per_seq]
  KvCacheSlots cu_q_lens;          // [S + 1]
  KvCacheSlots distribution;       // [3]
  bool causal = true;
  float sm_scale = 1.0f;
  int64_t sliding_window = 0;  // 0: none
  float soft_cap = 0.0f;       // 0: none
  bool has_mask_value = false;
  float mask_value = 0.0f;
  bool skip_kv_update = false;
  MutableStridedView<3> out;  // [T, Hq, D]
  MutableStridedView<2> lse;  // [T, Hq] fp32; data null when not wanted
};

// The index values: distribution cumulative and within S, cu_q_lens starting at 0 and
// non-decreasing over the active sequences and within T, decode sequences of one token,
// q_len <= kv_lens[s] <= pages_per_seq * page_size, every page a sequence uses in [0, P).
// Reads indices only; the errors name the argument, the entry, what was expected and got.
Status CheckRaggedPagedAttentionIndices(const RaggedPagedAttentionParams& params);

// slots[t] = the cache slot (page * page_size + offset) of token t, -1 for padding tokens: the
// slot_mapping kv_cache_update writes with. The indices must have passed the check above.
void RaggedPagedAttentionSlots(const RaggedPagedAttentionParams& params, int64_t* slots);

// The check, the update (kv_cache_update's core, unless skip_kv_update), then the attention.
// Nothing is written unless every check passed.
Status RaggedPagedAttention(const RaggedPagedAttentionParams& params, const RaggedPagedAttentionConfig& config);

RaggedPagedAttentionConfig RaggedPagedAttentionHeuristicConfig(const RaggedPagedAttentionShape& call, DType dtype,
                                                               const CpuInfo& cpu, RaggedPagedAttentionProduct product);
std::vector<RaggedPagedAttentionConfig> RaggedPagedAttentionConfigSpace(const RaggedPagedAttentionShape& call,
                                                                        DType dtype, const CpuInfo& cpu,
                                                                        RaggedPagedAttentionProduct product);

}  // namespace tokamax
