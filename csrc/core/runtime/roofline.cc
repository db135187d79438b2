#include "csrc/core/runtime/roofline.h"

#include <chrono>

#include "csrc/core/runtime/cpu_info.h"

namespace tokamax {

double FmaPeakAvx2(int64_t iterations);
double FmaPeakAvx512(int64_t iterations);
double AmxBf16Peak(int64_t iterations);
double DotBf16Peak(int64_t iterations);

double MeasureFmaPeakGflops(Isa isa, int64_t iterations) {
#ifdef TOKAMAX_HAVE_AVX512
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16 || isa == Isa::kAmx) return FmaPeakAvx512(iterations);  // fp32 FMA peak
#endif
#ifdef TOKAMAX_HAVE_AVX2
  if (isa == Isa::kAvx2) return FmaPeakAvx2(iterations);
#endif
  // Scalar tier: 12 independent scalar chains.
  float acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = 0.001f * i;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < 12; ++i) acc[i] = acc[i] * 0.999999f + 1e-7f;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = 0.0f;
  for (int i = 0; i < 12; ++i) sink = sink + acc[i];
  return static_cast<double>(iterations) * 12 * 2 / seconds * 1e-9;
}

double MeasureBf16ProductPeakGflops(Isa isa, int64_t iterations) {
#ifdef TOKAMAX_HAVE_AMX
  if (isa == Isa::kAmx) return AmxBf16Peak(iterations);
#endif
#ifdef TOKAMAX_HAVE_AVX512BF16
  if (isa == Isa::kAvx512Bf16) return DotBf16Peak(iterations);
#endif
  return 0.0;
}

double MeasureFmaPeakAvx512Gflops(int64_t iterations) {
#ifdef TOKAMAX_HAVE_AVX512
  if (GetCpuInfo().avx512f) return FmaPeakAvx512(iterations);
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
