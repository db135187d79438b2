// The tokamax:: operator library: the one TORCH_LIBRARY block (each op adds a fragment in its
// own file) and the hook that runs the core's parallel_for on torch's thread pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <chrono>
#include <string>
#include <vector>

#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/runtime/isa.h"
#include "csrc/core/runtime/large_buffer.h"
#include "csrc/core/runtime/scratch_arena.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/core/runtime/roofline.h"

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

// ATen runs contiguous float and double exp, log, tanh, ... on oneMKL's VML, one chunk per
// worker thread. VML picks each function's kernel on that function's first call, and when the
// first call runs on several threads at once one of them can run a low-accuracy kernel over its
// whole chunk (pytorch/pytorch#188792; seen here as the reference attention's first softmax off
// by 1.5e-4 in 1 fresh process in 30-70). A one-element call runs on the calling thread alone,
// so one per function and dtype at load settles every choice before any parallel call. The
// functions are those the references (and the ops' ATen fallbacks) use.
const bool kVmlDispatchSettled = [] {
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const at::Tensor one = at::full({1}, 0.5, at::TensorOptions().dtype(dtype));
    for (auto* function : {&at::exp, &at::expm1, &at::log, &at::log1p, &at::tanh, &at::sqrt, &at::erf}) {
      (void)function(one);
    }
  }
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

// Ceilings for benchmarks, measured on every torch thread at once:
// [fp32 FMA GFLOP/s with the active tier's vectors, with 256-bit AVX2 vectors (0 if absent),
//  read GB/s of `buffer`, bf16 product GFLOP/s of the tier's engine (0 without one)].
std::vector<double> MeasureCeilings(const at::Tensor& buffer, int64_t fma_iterations) {
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous() && buffer.device().is_cpu(),
              "_measure_ceilings: buffer must be a contiguous CPU float32 tensor");
  TORCH_CHECK(fma_iterations >= 0, "_measure_ceilings: fma_iterations must be >= 0 (0: bandwidth only), got ",
              fma_iterations);
  TORCH_CHECK(buffer.numel() >= at::get_num_threads(),
              "_measure_ceilings: buffer must hold at least one float per thread (", at::get_num_threads(),
              "), got ", buffer.numel());
  Isa isa;
  const Status status = ActiveIsa(&isa);
  TORCH_CHECK(status.ok(), status.message());
  const int64_t threads = at::get_num_threads();
  std::vector<double> fma(threads), fma256(threads), bandwidth(threads), bf16(threads);
  const int64_t chunk = buffer.numel() / threads;
  const float* data = buffer.const_data_ptr<float>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fma[t] = MeasureFmaPeakGflops(isa, fma_iterations);
  });
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      fma256[t] = IsaSupported(Isa::kAvx2, GetCpuInfo()) ? MeasureFmaPeakGflops(Isa::kAvx2, fma_iterations) : 0.0;
    }
  });
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) bf16[t] = MeasureBf16ProductPeakGflops(isa, isa == Isa::kAmx ? fma_iterations / 64 : fma_iterations);
  });
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) bandwidth[t] = MeasureReadBandwidthGbps(data + t * chunk, chunk);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double fma_total = 0.0, fma256_total = 0.0, bf16_total = 0.0;
  for (int64_t t = 0; t < threads; ++t) {
    fma_total += fma[t];
    fma256_total += fma256[t];
    bf16_total += bf16[t];
  }
  return {fma_total, fma256_total, static_cast<double>(chunk * threads) * 4 / seconds * 1e-9, bf16_total};
}

}  // namespace
}  // namespace tokamax

TORCH_LIBRARY(tokamax, m) {
  m.def("_cpu_description() -> str[]", &tokamax::CpuDescription);
  m.def("_measure_ceilings(Tensor buffer, int fma_iterations) -> float[]", &tokamax::MeasureCeilings);
  // The kernels' cached working memory (scratch_arena.h: idle scratch arenas and the large-buffer
  // cache): bytes held, and free all of it.
  m.def("_buffer_cache_bytes() -> int", [] { return static_cast<int64_t>(tokamax::CachedWorkingMemoryBytes()); });
  m.def("_empty_buffer_cache() -> ()", [] { tokamax::ReleaseCachedWorkingMemory(); });
  // The one limit on all of it (the large-buffer cache also holds freed op outputs: pooled outputs).
  m.def("_buffer_cache_limit() -> int", [] { return static_cast<int64_t>(tokamax::LargeBufferCacheLimit()); });
  m.def("_set_buffer_cache_limit(int nbytes) -> ()", [](int64_t nbytes) {
    TORCH_CHECK(nbytes >= 0, "set_cache_limit: nbytes must be >= 0, got ", nbytes);
    tokamax::SetLargeBufferCacheLimit(static_cast<size_t>(nbytes));
  });
}
