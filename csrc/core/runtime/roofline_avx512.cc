// The AVX-512 FMA-peak probe (the only 512-bit code so far): built with -mavx512f.
#include <immintrin.h>

#include <chrono>
#include <cstdint>

namespace tokamax {

double FmaPeakAvx512(int64_t iterations) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  const auto start = std::chrono::steady_clock::now();
  // The dependent chains cannot be folded or reordered (FMA is not associative) and feed the
  // sink below, so the loop stays as written.
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = 0.0f;
  for (int i = 0; i < 12; ++i) sink = sink + _mm512_reduce_add_ps(acc[i]);
  return static_cast<double>(iterations) * 12 * 16 * 2 / seconds * 1e-9;
}

}  // namespace tokamax
