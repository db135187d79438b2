// The avx512bf16 ceiling: independent vdpbf16ps chains (each instruction 16 lanes x 2 bf16
// multiply-adds into fp32), the rate the dot engine's inner loop issues at.
#include <immintrin.h>

#include <chrono>
#include <cstdint>

namespace tokamax {

double DotBf16Peak(int64_t iterations) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));  // bf16 1.0
  const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3380));  // bf16 ~6e-8
  const auto start = std::chrono::steady_clock::now();
  // Dependent chains that feed the sink below: the loop stays as written.
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = 0.0f;
  for (int i = 0; i < 12; ++i) sink = sink + _mm512_reduce_add_ps(acc[i]);
  return static_cast<double>(iterations) * 12 * 16 * 4 / seconds * 1e-9;
}

}  // namespace tokamax
