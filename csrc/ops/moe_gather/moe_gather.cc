// The moe_permute CPU kernel: a stable counting sort in three passes over fixed chunks.
#include "csrc/ops/moe_gather/moe_gather.h"

#include <algorithm>
#include <limits>
#include <string>

#include "csrc/core/base/int_math.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/parallel.h"

namespace tokamax {
namespace {

// Ids per chunk: the chunking is fixed (never derived from the thread count), so the placement
// is the same at any thread count; 16K ids keep the per-chunk histograms small next to the ids.
constexpr int64_t kPermuteChunk = int64_t{1} << 14;

}  // namespace

Status MoePermute(const MoePermuteParams& p) {
  const IndexMatrix& ids = p.expert_indices;
  const int64_t n = ids.rows * ids.cols, experts = p.num_experts;
  if (experts < 1 || experts > std::numeric_limits<int32_t>::max()) {
    return Status::Error("moe_permute: num_experts must be in [1, 2^31), got " + std::to_string(experts));
  }
  if (n > std::numeric_limits<int32_t>::max()) {
    return Status::Error("moe_permute: T*k must be below 2^31 (group_sizes are int32), got " + std::to_string(n));
  }
  const int64_t chunks = CeilDiv(n, kPermuteChunk);
  // counts[c * experts + e]: ids equal to e in chunk c; later, where chunk c places its next e.
  LargeBuffer<int64_t> counts(chunks * experts, LargeBuffer<int64_t>::kZeroed);
  LargeBuffer<int64_t> first_bad(std::max<int64_t>(chunks, 1), LargeBuffer<int64_t>::kUninitialized);
  auto id_at = [&](int64_t i) { return ids.cols == 0 ? 0 : ids.At(i / ids.cols, i % ids.cols); };
  ParallelFor(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      int64_t* count = &counts[c * experts];
      first_bad[c] = -1;
      for (int64_t i = c * kPermuteChunk, stop = std::min(n, i + kPermuteChunk); i < stop; ++i) {
        const int64_t e = id_at(i);
        if (e < 0 || e >= experts) {
          first_bad[c] = i;
          break;
        }
        ++count[e];
      }
    }
  });
  for (int64_t c = 0; c < chunks; ++c) {
    if (first_bad[c] >= 0) {
      const int64_t i = first_bad[c];
      return Status::Error("moe_permute: expert_indices[" + std::to_string(i / ids.cols) + ", " +
                           std::to_string(i % ids.cols) + "] must be in [0, num_experts=" + std::to_string(experts) +
                           "), got " + std::to_string(id_at(i)));
    }
  }
  // Exclusive prefix over (expert, chunk): expert e's rows start after all smaller experts', and
  // within e, chunk c's after the earlier chunks' (stability).
  int64_t next = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t start = next;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t count = counts[c * experts + e];
      counts[c * experts + e] = next;
      next += count;
    }
    p.group_sizes[e] = static_cast<int32_t>(next - start);
  }
  ParallelFor(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      int64_t* place = &counts[c * experts];
      for (int64_t i = c * kPermuteChunk, stop = std::min(n, i + kPermuteChunk); i < stop; ++i) {
        const int64_t pos = place[id_at(i)]++;
        p.order[pos] = i;
        p.inverse[i] = pos;
      }
    }
  });
  return Status::Ok();
}

}  // namespace tokamax
