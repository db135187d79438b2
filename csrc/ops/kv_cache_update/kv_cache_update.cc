// The kv_cache_update CPU kernel: tokens in parallel, each token's 2*Hkv rows copied with memcpy
// (with non-temporal stores for updates larger than the caches).
#include "csrc/ops/kv_cache_update/kv_cache_update.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "csrc/core/base/streaming.h"
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
  // decode one per sequence, usually in order): then there is no duplicate to look for.
  bool increasing = true;
  int64_t last = -1, valid = 0;
  for (int64_t t = 0; t < slots.count; ++t) {
    const int64_t slot = slots[t];
    if (slot < -1 || slot >= num_slots) {
      return Status::Error("kv_cache_update: slot_mapping[" + std::to_string(t) + "] must be -1 (skip) or in [0, " +
                           std::to_string(num_slots) + ") (total_pages * page_size), got " + std::to_string(slot));
    }
    if (slot == -1) continue;
    increasing = increasing && slot > last;
    last = slot;
    ++valid;
  }
  if (increasing) return Status::Ok();
  // Duplicates through an open-addressing set of the valid slots (at most half full): O(T), and
  // for a decode batch on the stack, no allocation at the fixed cost of a small call. The tokens
  // of a repeated slot are looked up only to name them in the error.
  constexpr int64_t kOnStack = 1024;
  int64_t capacity = 16;
  while (capacity < 2 * valid) capacity *= 2;
  int64_t on_stack[kOnStack];
  std::vector<int64_t> on_heap;
  int64_t* table = on_stack;
  if (capacity > kOnStack) {
    on_heap.resize(static_cast<size_t>(capacity));
    table = on_heap.data();
  }
  std::fill(table, table + capacity, int64_t{-1});
  const int shift = 64 - __builtin_ctzll(static_cast<uint64_t>(capacity));
  for (int64_t t = 0; t < slots.count; ++t) {
    const int64_t slot = slots[t];
    if (slot == -1) continue;
    // Fibonacci hashing: the top bits of slot * 2^64 / phi.
    uint64_t i = (static_cast<uint64_t>(slot) * 0x9E3779B97F4A7C15ull) >> shift;
    while (table[i] != -1 && table[i] != slot) i = (i + 1) & static_cast<uint64_t>(capacity - 1);
    if (table[i] == slot) {
      int64_t first = 0;
      while (slots[first] != slot) ++first;
      return Status::Error(DuplicateError(slot, first, t));
    }
    table[i] = slot;
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
  // Everything the copy loop reads, in locals: through the params the compiler reloads each
  // field after every memcpy (it may alias them), which perf showed as much time as the copies.
  char* const cache = static_cast<char*>(p.cache.data);
  const int64_t page_stride = p.cache.strides[0] * element, slot_stride = p.cache.strides[1] * element;
  const int64_t head_stride = p.cache.strides[2] * element;
  const char* const keys = static_cast<const char*>(p.keys.data);
  const char* const values = static_cast<const char*>(p.values.data);
  const int64_t k0 = p.keys.strides[0] * element, k1 = p.keys.strides[1] * element, k2 = p.keys.strides[2];
  const int64_t v0 = p.values.strides[0] * element, v1 = p.values.strides[1] * element, v2 = p.values.strides[2];
  const KvCacheSlots slots = p.slots;
  const int64_t row_bytes = d * element;
  auto slot_row = [=](int64_t slot) {
    return cache + (slot / page_size) * page_stride + (slot % page_size) * slot_stride;
  };
  // A prefill larger than the caches: rows written with non-temporal stores (prefill of 32768
  // tokens into a bf16 cache, 128 MiB, amd_zen5_avx512bf16, 2 threads: 8.6 -> 5.2 ms in slot
  // order, 11.6 -> 6.6 ms in random slots); smaller updates keep the cached copy, whose rows the
  // attention that follows reads (decode of 64 tokens 10.5 us cached against 15.7 streamed).
  const bool stream = p.slots.count * token_bytes >= kStreamOutputBytes && k2 == 1 && v2 == 1 &&
                      StreamCopyAligned(cache, row_bytes) && head_stride % 16 == 0 && slot_stride % 16 == 0 &&
                      page_stride % 16 == 0;
  auto copy_tokens = [=](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      char* dst = slot_row(slot);
      const char* key = keys + t * k0;
      const char* value = values + t * v0;
      // The next token's destination asked for (for writing) beside this token's copies: its slot
      // is a random 4 KiB in a cold cache, which no hardware prefetcher predicts (measured with
      // fresh slots and flushed caches: 512 tokens 218 -> 184 us, 64 tokens 45.6 -> 42.2 us).
      // Streamed rows are not read first, so nothing is asked for.
      const int64_t next_slot = !stream && t + 1 < end ? slots[t + 1] : -1;
      char* next = next_slot >= 0 ? slot_row(next_slot) : nullptr;
      for (int64_t h = 0; h < heads; ++h) {
        if (stream) {
          StreamCopy(dst + 2 * h * head_stride, key + h * k1, row_bytes);
          StreamCopy(dst + (2 * h + 1) * head_stride, value + h * v1, row_bytes);
          continue;
        }
        if (next != nullptr) {
          for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(next + 2 * h * head_stride + b, 1, 3);
            __builtin_prefetch(next + (2 * h + 1) * head_stride + b, 1, 3);
          }
        }
        CopyRow(dst + 2 * h * head_stride, key + h * k1, d, k2, element);
        CopyRow(dst + (2 * h + 1) * head_stride, value + h * v1, d, v2, element);
      }
    }
    if (stream) StreamCopyFence();
  };
  // ~64 KiB written per task: enough to pay for a task, fine enough to spread decode batches.
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / token_bytes);
  ParallelFor(0, p.slots.count, grain, copy_tokens);
  return Status::Ok();
}

}  // namespace tokamax
