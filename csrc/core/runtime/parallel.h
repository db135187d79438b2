// Threading interface of the core. Kernels split work with ParallelFor; whoever embeds the core
// installs a backend (the torch extension installs at::parallel_for, so torch.set_num_threads is
// honoured). Without a backend the work runs serially on the calling thread.
#pragma once

#include <cstdint>
#include <functional>

namespace tokamax {

using ParallelBody = std::function<void(int64_t begin, int64_t end)>;
// Must call body on disjoint sub-ranges covering [begin, end), each at least `grain` long
// except possibly the last, and return once all calls have finished.
using ParallelBackend = void (*)(int64_t begin, int64_t end, int64_t grain, const ParallelBody& body);

void SetParallelBackend(ParallelBackend backend);
void ParallelFor(int64_t begin, int64_t end, int64_t grain, const ParallelBody& body);

}  // namespace tokamax
