// Ceilings measured in the same run as a benchmark: fp32 FMA peak and memory read bandwidth.
#pragma once

#include <cstdint>

#include "csrc/core/isa.h"

namespace tokamax {

// GFLOP/s of independent fp32 FMAs on the calling thread with `isa`'s widest vectors
// (12 accumulators, enough to hide the FMA latency on current cores).
double MeasureFmaPeakGflops(Isa isa, int64_t iterations);
// GFLOP/s with 512-bit vectors, or 0 when the CPU has no AVX-512F.
double MeasureFmaPeakAvx512Gflops(int64_t iterations);
// GFLOP/s of bf16 AMX tile products (fp32 accumulation) on the calling thread, operands
// loaded from L1 each step; 0 unless the amx tier is supported.
double MeasureAmxBf16PeakGflops(int64_t iterations);
// GB/s reading `bytes` of `buffer` once (sums into a sink so the reads cannot be elided).
double MeasureReadBandwidthGbps(const float* buffer, int64_t count);

}  // namespace tokamax
