// The avx2 FMA-peak probe: built with -mavx2 -mfma like every *_avx2.cc file.
#include <immintrin.h>

#include <chrono>
#include <cstdint>

namespace tokamax {

double FmaPeakAvx2(int64_t iterations) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  const auto start = std::chrono::steady_clock::now();
  // The dependent chains cannot be folded or reordered (FMA is not associative) and feed the
  // sink below, so the loop stays as written.
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = 0.0f;
  for (int i = 0; i < 12; ++i) sink = sink + _mm256_cvtss_f32(acc[i]);
  return static_cast<double>(iterations) * 12 * 8 * 2 / seconds * 1e-9;
}

}  // namespace tokamax
