#include "csrc/core/runtime/roofline.h"

#include <chrono>

#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/vec/tiers.h"

namespace tokamax {

TOKAMAX_DECLARE_IN_TIERS(double FmaPeak(int64_t iterations); double Bf16ProductPeak(int64_t iterations);)

double MeasureFmaPeakGflops(Isa isa, int64_t iterations) {
  // The fp32 FMA peak of the tier's widest vectors.
  TOKAMAX_RETURN_BY_VECTOR_WIDTH(isa, FmaPeak(iterations));
}

double MeasureBf16ProductPeakGflops(Isa isa, int64_t iterations) {
#ifdef TOKAMAX_HAVE_AMX
  if (isa == Isa::kAmx) return tier_amx::Bf16ProductPeak(iterations);
#endif
#ifdef TOKAMAX_HAVE_AVX512BF16
  if (isa == Isa::kAvx512Bf16) return tier_avx512bf16::Bf16ProductPeak(iterations);
#endif
  return 0.0;
}

double MeasureFmaPeakAvx512Gflops(int64_t iterations) {
#ifdef TOKAMAX_HAVE_AVX512
  if (GetCpuInfo().avx512f) return tier_avx512::FmaPeak(iterations);
#endif
  return 0.0;
}

double MeasureReadBandwidthGbps(const float* buffer, int64_t count) {
  const auto start = std::chrono::steady_clock::now();
  float sums[16] = {};
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    for (int j = 0; j < 16; ++j) sums[j] += buffer[i + j];
  }
  for (; i < count; ++i) sums[0] += buffer[i];
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = 0.0f;
  for (float s : sums) sink = sink + s;
  return static_cast<double>(count) * 4 / seconds * 1e-9;
}

}  // namespace tokamax
