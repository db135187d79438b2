// The tokamax:: operator library: the one TORCH_LIBRARY block (each op adds a fragment in its
// own file) and the hook that runs the core's parallel_for on torch's thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "csrc/core/cpu_info.h"
#include "csrc/core/isa.h"
#include "csrc/core/parallel.h"

namespace tokamax {
namespace {

void AtenParallelFor(int64_t begin, int64_t end, int64_t grain, const ParallelBody& body) {
  at::parallel_for(begin, end, grain, [&](int64_t chunk_begin, int64_t chunk_end) { body(chunk_begin, chunk_end); });
}

// Installed when the library is loaded, so every kernel honours torch.set_num_threads.
const bool kParallelBackendInstalled = [] {
  SetParallelBackend(&AtenParallelFor);
  return true;
}();

// Facts about this CPU for device_kind() and benchmark reports:
// [vendor, microarchitecture, active ISA tier, L1d bytes, L2 bytes, L3 bytes].
std::vector<std::string> CpuDescription() {
  const CpuInfo& info = GetCpuInfo();
  Isa isa;
  const Status status = ActiveIsa(&isa);
  TORCH_CHECK(status.ok(), status.message());
  return {info.vendor, MicroarchitectureName(info), IsaName(isa), std::to_string(info.l1d_bytes),
          std::to_string(info.l2_bytes), std::to_string(info.l3_bytes)};
}

}  // namespace
}  // namespace tokamax

TORCH_LIBRARY(tokamax, m) {
  m.def("_cpu_description() -> str[]", &tokamax::CpuDescription);
}
