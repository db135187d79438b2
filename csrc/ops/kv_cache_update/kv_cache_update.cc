// The kv_cache_update CPU kernel: tokens in parallel, each token's 2*Hkv rows copied with memcpy.
#include "csrc/ops/kv_cache_update/kv_cache_update.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "csrc/core/runtime/parallel.h"

namespace tokamax {
namespace {

std::string DuplicateError(int64_t slot, int64_t first, int64_t second) {
  return "kv_cache_update: slot_mapping must not repeat a slot (the result would depend on the write order), "
         "got slot " + std::to_string(slot) + " for tokens " + std::to_string(first) + " and " +
         std::to_string(second);
}

// One row of D elements from a strided source into a contiguous destination row.
void CopyRow(char* dst, const char* src, int64_t d, int64_t src_stride, int64_t element) {
  if (src_stride == 1 || d <= 1) {
    std::memcpy(dst, src, static_cast<size_t>(d * element));
    return;
  }
  for (int64_t j = 0; j < d; ++j) std::memcpy(dst + j * element, src + j * src_stride * element, element);
}

}  // namespace

Status CheckKvCacheSlots(const KvCacheSlots& slots, int64_t num_slots) {
  // Range, and whether the valid slots already increase (prefill writes consecutive slots;
  // decode one per sequence, usually in order): then there is no duplicate and no sort.
  bool increasing = true;
  int64_t last = -1;
  for (int64_t t = 0; t < slots.count; ++t) {
    const int64_t slot = slots[t];
    if (slot < -1 || slot >= num_slots) {
      return Status::Error("kv_cache_update: slot_mapping[" + std::to_string(t) + "] must be -1 (skip) or in [0, " +
                           std::to_string(num_slots) + ") (total_pages * page_size), got " + std::to_string(slot));
    }
    if (slot == -1) continue;
    increasing = increasing && slot > last;
    last = slot;
  }
  if (increasing) return Status::Ok();
  std::vector<std::pair<int64_t, int64_t>> sorted;  // (slot, token)
  sorted.reserve(static_cast<size_t>(slots.count));
  for (int64_t t = 0; t < slots.count; ++t) {
    if (slots[t] != -1) sorted.emplace_back(slots[t], t);
  }
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].first == sorted[i - 1].first) {
      return Status::Error(DuplicateError(sorted[i].first, sorted[i - 1].second, sorted[i].second));
    }
  }
  return Status::Ok();
}

Status KvCacheUpdate(const KvCacheUpdateParams& p) {
  const int64_t pages = p.cache.sizes[0], page_size = p.cache.sizes[1];
  const Status status = CheckKvCacheSlots(p.slots, pages * page_size);
  if (!status.ok()) return status;
  const int64_t heads = p.keys.sizes[1], d = p.keys.sizes[2];
  const int64_t element = DTypeSize(p.cache.dtype);
  const int64_t token_bytes = 2 * heads * d * element;
  if (p.slots.count == 0 || token_bytes == 0) return Status::Ok();
  // ~64 KiB written per task: enough to pay for a task, fine enough to spread decode batches.
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / token_bytes);
  ParallelFor(0, p.slots.count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = p.slots[t];
      if (slot < 0) continue;
      const int64_t page = slot / page_size, offset = slot % page_size;
      for (int64_t h = 0; h < heads; ++h) {
        CopyRow(static_cast<char*>(p.cache.At(page, offset, 2 * h, 0)), static_cast<const char*>(p.keys.At(t, h, 0)),
                d, p.keys.strides[2], element);
        CopyRow(static_cast<char*>(p.cache.At(page, offset, 2 * h + 1, 0)),
                static_cast<const char*>(p.values.At(t, h, 0)), d, p.values.strides[2], element);
      }
    }
  });
  return Status::Ok();
}

}  // namespace tokamax
