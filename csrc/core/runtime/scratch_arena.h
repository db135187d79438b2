// The kernels' per-call scratch (packed GEMM panels, tile buffers, attention's per-task
// operands): one arena per thread and nesting level, its buffers kept between calls so a steady
// state allocates nothing, and registered process-wide so that another thread can free them.
//
// A kernel takes a ScratchLease on the calling thread once per call or task (never per tile: it
// locks the arena's mutex on entry and on exit) and gets typed, grow-on-demand buffers from its
// slots. A lease taken while the same thread holds another (attention's task calling a GEMM
// packer that needs scratch) gets the next arena of the thread's stack, so the inner buffers never
// alias the outer ones.
//
// Bound: one limit, LargeBufferCacheLimit() (TOKAMAX_BUFFER_CACHE_MIB; default 1/8 of memory,
// clamped to [256 MiB, 4 GiB]), covers everything cached: arenas first (small, reused by every
// call), the large-buffer cache (large_buffer.h) gets what they leave. A lease that ends while all arenas together hold more
// than the limit frees its arena. ReleaseCachedWorkingMemory frees every idle arena and unmaps the
// large-buffer cache; an arena leased at that moment frees itself when its lease ends (memory in
// use is never freed). A thread's arenas are freed when the thread exits.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tokamax {

struct ScratchSlot {
  void* data = nullptr;
  size_t bytes = 0;
};

class ScratchArena;

class ScratchLease {
 public:
  static constexpr int kSlots = 32;

  ScratchLease();
  ~ScratchLease();
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;

  // `count` T in slot `slot` (0 <= slot < kSlots), 64-byte aligned, valid until the lease ends
  // or the slot is asked for more. Grown as std::vector::resize grows: what the slot held is
  // kept, bytes it never held are zero.
  template <typename T>
  T* Get(int slot, int64_t count) {
    const size_t bytes = static_cast<size_t>(count > 0 ? count : 1) * sizeof(T);
    ScratchSlot& s = slots_[slot];
    return static_cast<T*>(s.bytes >= bytes ? s.data : Grow(slot, bytes));
  }

 private:
  void* Grow(int slot, size_t bytes);
  ScratchArena* arena_;
  ScratchSlot* slots_;
};

// Bytes the idle arenas hold (leased ones are in use, not cached).
size_t ScratchIdleBytes();
// Bytes all arenas hold, idle or leased (what the limit bounds). Lock-free.
size_t ScratchHeldBytes();
// Frees every idle arena; a leased one frees itself when its lease ends.
void ReleaseScratch();
// Arenas registered, one per thread and nesting level it has used (tests: threads unregister).
size_t ScratchArenaCount();

// What tokamax_torch.cached_bytes() and empty_cache() report and do: idle scratch plus the
// large-buffer cache.
size_t CachedWorkingMemoryBytes();
void ReleaseCachedWorkingMemory();

}  // namespace tokamax
