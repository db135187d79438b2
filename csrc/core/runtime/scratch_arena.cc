#include "csrc/core/runtime/scratch_arena.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include "csrc/core/runtime/large_buffer.h"

namespace tokamax {

namespace {

constexpr size_t kAlign = 64;

std::atomic<size_t> g_held{0};  // bytes of all arenas' slots, idle or leased

}  // namespace

// One thread's scratch at one nesting level. The owner thread touches the slots while `leased`
// without the mutex: other threads (release, cached-bytes) read or free them only under the mutex
// and only while not leased, and the lease's lock/unlock orders the two.
class ScratchArena {
 public:
  ScratchSlot slots[ScratchLease::kSlots];
  std::mutex mutex;
  bool leased = false;           // under mutex
  bool release_requested = false;  // under mutex: freed when the lease ends
  bool grew = false;             // owner only, during a lease
  size_t bytes = 0;              // sum of the slots' bytes

  void FreeAll() {
    for (ScratchSlot& s : slots) {
      std::free(s.data);
      s = ScratchSlot{};
    }
    g_held.fetch_sub(bytes, std::memory_order_relaxed);
    bytes = 0;
  }
};

namespace {

class Registry {
 public:
  static Registry& Get() {
    static Registry* registry = new Registry();  // never destroyed: threads may exit after statics
    return *registry;
  }
  std::mutex mutex;
  std::vector<ScratchArena*> arenas;
};

// The calling thread's arenas, one per nesting level; unregistered and freed when it exits.
struct ThreadArenas {
  std::vector<std::unique_ptr<ScratchArena>> levels;
  size_t depth = 0;

  ScratchArena* Push() {
    if (depth == levels.size()) {
      levels.push_back(std::make_unique<ScratchArena>());
      Registry& r = Registry::Get();
      std::lock_guard<std::mutex> lock(r.mutex);
      r.arenas.push_back(levels.back().get());
    }
    return levels[depth++].get();
  }

  ~ThreadArenas() {
    Registry& r = Registry::Get();
    for (const auto& arena : levels) {
      {
        std::lock_guard<std::mutex> lock(r.mutex);
        r.arenas.erase(std::find(r.arenas.begin(), r.arenas.end(), arena.get()));
      }
      // Unreachable from other threads now (they reach arenas only under the registry mutex).
      arena->FreeAll();
    }
  }
};

thread_local ThreadArenas t_arenas;

}  // namespace

ScratchLease::ScratchLease() : arena_(t_arenas.Push()), slots_(arena_->slots) {
  std::lock_guard<std::mutex> lock(arena_->mutex);
  arena_->leased = true;
}

ScratchLease::~ScratchLease() {
  const bool grew = arena_->grew;
  arena_->grew = false;
  {
    std::lock_guard<std::mutex> lock(arena_->mutex);
    arena_->leased = false;
    if (arena_->release_requested || g_held.load(std::memory_order_relaxed) > LargeBufferCacheLimit()) {
      arena_->FreeAll();
    }
    arena_->release_requested = false;
  }
  --t_arenas.depth;
  // The arenas took more of the shared limit: the large-buffer cache gives up what no longer fits.
  if (grew) TrimLargeBufferCache();
}

void* ScratchLease::Grow(int slot, size_t bytes) {
  ScratchSlot& s = slots_[slot];
  // At least 1.5x: a slot asked for a little more each call is not copied each call.
  size_t size = std::max(bytes, s.bytes + s.bytes / 2);
  size = (size + kAlign - 1) / kAlign * kAlign;
  void* data = std::aligned_alloc(kAlign, size);
  if (data == nullptr) throw std::bad_alloc();
  if (s.bytes > 0) std::memcpy(data, s.data, s.bytes);
  std::memset(static_cast<char*>(data) + s.bytes, 0, size - s.bytes);
  std::free(s.data);
  g_held.fetch_add(size - s.bytes, std::memory_order_relaxed);
  arena_->bytes += size - s.bytes;
  arena_->grew = true;
  s.data = data;
  s.bytes = size;
  return data;
}

size_t ScratchIdleBytes() {
  Registry& r = Registry::Get();
  std::lock_guard<std::mutex> lock(r.mutex);
  size_t idle = 0;
  for (ScratchArena* arena : r.arenas) {
    std::lock_guard<std::mutex> arena_lock(arena->mutex);
    if (!arena->leased) idle += arena->bytes;
  }
  return idle;
}

size_t ScratchHeldBytes() { return g_held.load(std::memory_order_relaxed); }

void ReleaseScratch() {
  Registry& r = Registry::Get();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (ScratchArena* arena : r.arenas) {
    std::lock_guard<std::mutex> arena_lock(arena->mutex);
    if (arena->leased) {
      arena->release_requested = true;
    } else {
      arena->FreeAll();
    }
  }
}

size_t ScratchArenaCount() {
  Registry& r = Registry::Get();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.arenas.size();
}

size_t CachedWorkingMemoryBytes() { return LargeBufferCachedBytes() + ScratchIdleBytes(); }

void ReleaseCachedWorkingMemory() {
  ReleaseScratch();
  ReleaseLargeBufferCache();
}

}  // namespace tokamax
