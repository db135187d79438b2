// kv_cache_update: writes the keys and values of T new tokens into a paged KV cache, in place.
// Cache layout [total_pages, page_size, 2*Hkv, D], K and V interleaved per head (merged head 2h is
// K of head h, 2h+1 its V), the upstream ragged paged attention layout without TPU padding of D.
// Token t goes to slot slot_mapping[t] = page * page_size + offset; -1 skips it (padding).
// Nothing to tile or tune: the op has no Config.
#pragma once

#include <cstdint>

#include "csrc/core/base/status.h"
#include "csrc/core/base/strided_view.h"

namespace tokamax {

// The slot indices: T values of int32 or int64, `stride` elements apart.
struct KvCacheSlots {
  const void* data = nullptr;
  bool is_int64 = true;
  int64_t count = 0;
  int64_t stride = 1;

  int64_t operator[](int64_t t) const {
    return is_int64 ? static_cast<const int64_t*>(data)[t * stride]
                    : static_cast<const int32_t*>(data)[t * stride];
  }
};

// Shapes and dtypes are the adapter's to check; the kernel checks the slot values. cache's last
// dimension has stride 1 (rows are copied with memcpy); keys and values may have any strides.
struct KvCacheUpdateParams {
  MutableStridedView<4> cache;  // [P, S, 2H, D]
  StridedView<3> keys;          // [T, H, D]
  StridedView<3> values;        // [T, H, D]
  KvCacheSlots slots;           // [T]
};

// Every slot in [-1, P*S) and no slot twice (the result would depend on the write order).
// Reads slot values only; the error names the token(s) and the slot. Allocates O(T) at most.
Status CheckKvCacheSlots(const KvCacheSlots& slots, int64_t num_slots);

// CheckKvCacheSlots, then the writes: nothing is written unless every slot is valid.
Status KvCacheUpdate(const KvCacheUpdateParams& params);

}  // namespace tokamax
