// The AMX bf16 ceiling: the rate of a 2x2 block of tile products whose operands are reloaded
// from L1 every step, as a GEMM's inner loop does (pure tile products without loads run about
// twice as fast on the dev machine, but no product can avoid loading its operands).
#include <immintrin.h>

#include <chrono>
#include <cstdint>

#include "csrc/core/gemm/amx_gemm.h"

namespace tokamax {

double AmxBf16Peak(int64_t iterations) {
  alignas(64) static thread_local uint16_t operands[4][16 * 32];  // 4 KiB, zeros
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
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float keep = sink[0];
  (void)keep;
  return static_cast<double>(iterations) * 4 * 16 * 16 * 32 * 2 / seconds * 1e-9;
}

}  // namespace tokamax
