// The one stable counting sort of the MoE data-movement ops (moe_permute's order, the
// deterministic scatter-add of ragged_gather_reduce's backward). Header-only: the key function
// is inlined per caller.
#pragma once

#include <algorithm>
#include <cstdint>

#include "csrc/core/base/int_math.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/parallel.h"

namespace tokamax {

// Sorts positions [0, n) by key_at(i) in [0, num_keys), stable. Writes order[n] (positions by
// key), inverse[n] (nullable; inverse[order[i]] = i) and starts[num_keys + 1] (key k's positions
// are order[starts[k] .. starts[k+1])). Returns the first position whose key is out of range, or
// -1; on error nothing is written.
//
// Chunks of at least 16K positions, never fewer positions than keys (so the per-chunk histograms
// take O(n + num_keys) memory), are counted and placed in parallel; the chunking depends on n and
// num_keys only, so the result is the same at any thread count.
template <typename KeyAt>
int64_t StableCountingSort(int64_t n, int64_t num_keys, const KeyAt& key_at, int64_t* order, int64_t* inverse,
                           int64_t* starts) {
  const int64_t chunk = std::max<int64_t>(int64_t{1} << 14, num_keys);
  const int64_t chunks = CeilDiv(n, chunk);
  // counts[c * num_keys + k]: keys k in chunk c; after the prefix sum, where chunk c puts its next k.
  LargeBuffer<int64_t> counts(chunks * num_keys, LargeBuffer<int64_t>::kZeroed);
  LargeBuffer<int64_t> first_bad(std::max<int64_t>(chunks, 1), LargeBuffer<int64_t>::kUninitialized);
  ParallelFor(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      int64_t* count = &counts[c * num_keys];
      first_bad[c] = -1;
      for (int64_t i = c * chunk, stop = std::min(n, i + chunk); i < stop; ++i) {
        const int64_t key = key_at(i);
        if (key < 0 || key >= num_keys) {
          first_bad[c] = i;
          break;
        }
        ++count[key];
      }
    }
  });
  for (int64_t c = 0; c < chunks; ++c) {
    if (first_bad[c] >= 0) return first_bad[c];
  }
  // Key k's positions start after all smaller keys'; within k, chunk c's after earlier chunks'.
  int64_t next = 0;
  for (int64_t key = 0; key < num_keys; ++key) {
    starts[key] = next;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t count = counts[c * num_keys + key];
      counts[c * num_keys + key] = next;
      next += count;
    }
  }
  starts[num_keys] = next;
  ParallelFor(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      int64_t* place = &counts[c * num_keys];
      for (int64_t i = c * chunk, stop = std::min(n, i + chunk); i < stop; ++i) {
        const int64_t pos = place[key_at(i)]++;
        order[pos] = i;
        if (inverse != nullptr) inverse[i] = pos;
      }
    }
  });
  return -1;
}

}  // namespace tokamax
