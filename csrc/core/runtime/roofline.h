// Ceilings measured in the same run as a benchmark: fp32 FMA peak and memory read bandwidth.
#pragma once

#include <cstdint>

#include "csrc/core/runtime/isa.h"

namespace tokamax {

// GFLOP/s of independent fp32 FMAs on the calling thread with `isa`'s widest vectors
// (12 accumulators, enough to hide the FMA latency on current cores).
double MeasureFmaPeakGflops(Isa isa, int64_t iterations);
// GFLOP/s with 512-bit vectors, or 0 when the CPU has no AVX-512F.
double MeasureFmaPeakAvx512Gflops(int64_t iterations);
// GFLOP/s of `isa`'s bf16 product engine (bf16_gemm.h, fp32 accumulation) on the calling
// thread: AMX tile products with operands loaded from L1 each step (amx), or independent
// vdpbf16ps chains (avx512bf16); 0 for tiers without one. `isa` must be supported.
double MeasureBf16ProductPeakGflops(Isa isa, int64_t iterations);
// GB/s reading `bytes` of `buffer` once (sums into a sink so the reads cannot be elided).
double MeasureReadBandwidthGbps(const float* buffer, int64_t count);

}  // namespace tokamax
