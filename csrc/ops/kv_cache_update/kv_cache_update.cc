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

// Everything the copy loop reads. CopyTokenRows works on a local copy: read through a reference
// (or a lambda's captures, which live in the std::function's storage) the compiler reloads each
// field after every memcpy, which may alias them (perf, decode of 64 tokens: 15% of the samples in
// the loop's own code, the reloads among its hottest instructions).
struct TokenRows {
  char* cache;
  int64_t page_size, page_stride, slot_stride, head_stride;
  bool flat_slots;  // pages laid end to end: a slot's row is cache + slot * slot_stride
  const char* keys;
  const char* values;
  int64_t k0, k1, k2, v0, v1, v2;  // bytes, bytes, elements
  KvCacheSlots slots;
  int64_t heads, d, element, row_bytes;
  bool stream;
};

void CopyTokenRows(const TokenRows& shared, int64_t begin, int64_t end) {
  const TokenRows r = shared;
  auto slot_row = [&r](int64_t slot) {
    return r.flat_slots ? r.cache + slot * r.slot_stride
                        : r.cache + (slot / r.page_size) * r.page_stride + (slot % r.page_size) * r.slot_stride;
  };
  // CopyRow's own test, made once for the call: the usual rows take one memcpy each.
  const bool contiguous_rows = r.k2 == 1 && r.v2 == 1;
  char* next = nullptr;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = r.slots[t];
    if (slot < 0) continue;
    char* const dst = next != nullptr ? next : slot_row(slot);
    const char* const key = r.keys + t * r.k0;
    const char* const value = r.values + t * r.v0;
    // The next token's destination asked for beside this token's copies: its slot is a random
    // 4 KiB in a cold cache, which no hardware prefetcher predicts (measured with fresh slots and
    // flushed caches: 512 tokens 218 -> 184 us, 64 tokens 45.6 -> 42.2 us). Streamed rows are not
    // read first, so nothing is asked for.
    const int64_t next_slot = t + 1 < end ? r.slots[t + 1] : -1;
    next = next_slot >= 0 ? slot_row(next_slot) : nullptr;
    char* const ask = r.stream ? nullptr : next;
    for (int64_t h = 0; h < r.heads; ++h) {
      char* const k_row = dst + 2 * h * r.head_stride;
      char* const v_row = k_row + r.head_stride;
      if (r.stream) {
        StreamCopy(k_row, key + h * r.k1, r.row_bytes);
        StreamCopy(v_row, value + h * r.v1, r.row_bytes);
        continue;
      }
      if (ask != nullptr) {
        for (int64_t b = 0; b < r.row_bytes; b += 64) {
          __builtin_prefetch(ask + 2 * h * r.head_stride + b, 1, 3);
          __builtin_prefetch(ask + (2 * h + 1) * r.head_stride + b, 1, 3);
        }
      }
      if (contiguous_rows) {
        std::memcpy(k_row, key + h * r.k1, static_cast<size_t>(r.row_bytes));
        std::memcpy(v_row, value + h * r.v1, static_cast<size_t>(r.row_bytes));
      } else {
        CopyRow(k_row, key + h * r.k1, r.d, r.k2, r.element);
        CopyRow(v_row, value + h * r.v1, r.d, r.v2, r.element);
      }
    }
  }
  if (r.stream) StreamCopyFence();
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
  TokenRows rows;
  rows.cache = static_cast<char*>(p.cache.data);
  rows.page_size = page_size;
  rows.page_stride = p.cache.strides[0] * element;
  rows.slot_stride = p.cache.strides[1] * element;
  rows.head_stride = p.cache.strides[2] * element;
  rows.flat_slots = rows.page_stride == page_size * rows.slot_stride;
  rows.keys = static_cast<const char*>(p.keys.data);
  rows.values = static_cast<const char*>(p.values.data);
  rows.k0 = p.keys.strides[0] * element;
  rows.k1 = p.keys.strides[1] * element;
  rows.k2 = p.keys.strides[2];
  rows.v0 = p.values.strides[0] * element;
  rows.v1 = p.values.strides[1] * element;
  rows.v2 = p.values.strides[2];
  rows.slots = p.slots;
  rows.heads = heads;
  rows.d = d;
  rows.element = element;
  rows.row_bytes = d * element;
  // A prefill larger than the caches: rows written with non-temporal stores (prefill of 32768
  // tokens into a bf16 cache, 128 MiB, amd_zen5_avx512bf16, 2 threads: 8.6 -> 5.2 ms in slot
  // order, 11.6 -> 6.6 ms in random slots); smaller updates keep the cached copy, whose rows the
  // attention that follows reads (decode of 64 tokens 10.5 us cached against 15.7 streamed).
  rows.stream = p.slots.count * token_bytes >= kStreamOutputBytes && rows.k2 == 1 && rows.v2 == 1 &&
                StreamCopyAligned(rows.cache, rows.row_bytes) && rows.head_stride % 16 == 0 &&
                rows.slot_stride % 16 == 0 && rows.page_stride % 16 == 0;
  // ~64 KiB written per task: enough to pay for a task, fine enough to spread decode batches.
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / token_bytes);
  ParallelFor(0, p.slots.count, grain, [&rows](int64_t begin, int64_t end) { CopyTokenRows(rows, begin, end); });
  return Status::Ok();
}

}  // namespace tokamax
