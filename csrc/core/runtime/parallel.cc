#include "csrc/core/runtime/parallel.h"

#include <atomic>

namespace tokamax {
namespace {

void SerialBackend(int64_t begin, int64_t end, int64_t, const ParallelBody& body) {
  if (begin < end) body(begin, end);
}

std::atomic<ParallelBackend> g_backend{&SerialBackend};

}  // namespace

void SetParallelBackend(ParallelBackend backend) {
  g_backend.store(backend != nullptr ? backend : &SerialBackend);
}

void ParallelFor(int64_t begin, int64_t end, int64_t grain, const ParallelBody& body) {
  if (begin >= end) return;
  g_backend.load()(begin, end, grain < 1 ? 1 : grain, body);
}

}  // namespace tokamax
