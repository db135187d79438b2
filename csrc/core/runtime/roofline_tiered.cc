// The compute ceilings of roofline.h, one per tier: independent FMA chains on the tier's widest
// vectors (the scalar tier included), the bf16 dot instruction (avx512bf16), and AMX tile
// products (amx). Each loop's results feed a sink, so the loop stays as written.
// tokamax-tiers: scalar avx2 avx512 avx512bf16 amx
#include "csrc/core/vec/vec.h"

#include <chrono>

#if defined(TOKAMAX_TIER_AMX)
#include "csrc/core/gemm/amx_gemm.h"
#endif

namespace tokamax {
namespace TOKAMAX_TIER_NAMESPACE {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// GFLOP/s of 12 independent fp32 FMA chains: enough to hide the FMA latency on current cores.
// The chains cannot be folded or reordered (FMA is not associative).
double FmaPeak(int64_t iterations) {
  Vec acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = Set1(0.001f * i);
  const Vec a = Set1(0.999999f), b = Set1(1e-7f);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < 12; ++i) acc[i] = Fma(acc[i], a, b);
  }
  const double seconds = SecondsSince(start);
  volatile float sink = 0.0f;
  for (int i = 0; i < 12; ++i) sink = sink + ReduceAdd(acc[i]);
  return static_cast<double>(iterations) * 12 * kLanes * 2 / seconds * 1e-9;
}

#if defined(TOKAMAX_TIER_AVX512BF16)
// Independent vdpbf16ps chains (each instruction 16 lanes x 2 bf16 multiply-adds into fp32),
// the rate the dot engine's inner loop issues at.
double Bf16ProductPeak(int64_t iterations) {
  Vec acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = Set1(0.001f * i);
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));  // bf16 1.0
  const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3380));  // bf16 ~6e-8
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  const double seconds = SecondsSince(start);
  volatile float sink = 0.0f;
  for (int i = 0; i < 12; ++i) sink = sink + ReduceAdd(acc[i]);
  return static_cast<double>(iterations) * 12 * 16 * 4 / seconds * 1e-9;
}
#endif

#if defined(TOKAMAX_TIER_AMX)
// The rate of a 2x2 block of tile products whose operands are reloaded from L1 every step, as
// a GEMM's inner loop does (pure tile products without loads run about twice as fast on the
// dev machine, but no product can avoid loading its operands).
double Bf16ProductPeak(int64_t iterations) {
  alignas(64) uint16_t operands[4][16 * 32] = {};  // 4 KiB of zeros
  AmxTileScope tiles;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it) {
    _tile_loadd(4, operands[0], 64);
    _tile_loadd(6, operands[1], 64);
    _tile_loadd(5, operands[2], 64);
    _tile_loadd(7, operands[3], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float sink[16 * 16];
  _tile_stored(0, sink, 64);  // the products feed memory, so the loop stays
  const double seconds = SecondsSince(start);
  volatile float keep = sink[0];
  (void)keep;
  return static_cast<double>(iterations) * 4 * 16 * 16 * 32 * 2 / seconds * 1e-9;
}
#endif

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
