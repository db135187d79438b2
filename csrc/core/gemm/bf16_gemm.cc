// Which bf16 product engine a tier runs, and the per-thread state it needs.
#include "csrc/core/gemm/bf16_gemm.h"

#include <cstdio>
#include <cstdlib>

#include "csrc/core/gemm/amx_gemm.h"

namespace tokamax {

Bf16Products GetBf16Products(Isa isa) {
  Bf16Products products;
#ifdef TOKAMAX_HAVE_AMX
  if (isa == Isa::kAmx) {
    products.gemm = AmxGemmBf16;
    products.column_dots = ColumnDotsBf16;
    products.tile_unit = true;
  }
#endif
#ifdef TOKAMAX_HAVE_AVX512BF16
  if (isa == Isa::kAvx512Bf16) {
    products.gemm = DotGemmBf16;
    products.column_dots = ColumnDotsBf16;
  }
#endif
  return products;
}

Bf16ProductScope::Bf16ProductScope(const Bf16Products& products) {
#ifdef TOKAMAX_HAVE_AMX
  if (products.tile_unit) tiles_.reset(new AmxTileScope());
#endif
}

Bf16ProductScope::~Bf16ProductScope() = default;

#if !defined(TOKAMAX_HAVE_AVX512BF16) || !defined(TOKAMAX_HAVE_AMX)
namespace {

// Reached only by a caller that skipped the GetBf16Products check: a bug, never bad input.
[[noreturn]] void MissingTier(const char* function, const char* tier) {
  std::fprintf(stderr, "tokamax: %s needs the %s tier, which this build does not have\n", function, tier);
  std::abort();
}

}  // namespace
#endif

// Builds without a tier (non-x86: IsaBuilt) have no bf16 engine, so nothing packs operands for
// one or opens a tile scope; the callers are compiled on every processor all the same, and
// these definitions only satisfy the linker.
#ifndef TOKAMAX_HAVE_AVX512BF16
void PackVnniFromRows(const float*, int64_t, int64_t, int64_t, int64_t, uint16_t*) { MissingTier(__func__, "avx512bf16"); }
void ExpPackVnni(const float*, int64_t, int64_t, int64_t, int64_t, const float*, float*, uint16_t*) {
  MissingTier(__func__, "avx512bf16");
}
void PackVnniFromBf16Rows(const uint16_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*) {
  MissingTier(__func__, "avx512bf16");
}
void PackVnniPair(const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, uint16_t*) { MissingTier(__func__, "avx512bf16"); }
void PackVnniFromBf16Vectors(const uint16_t* const[16], int64_t, int64_t, int64_t, uint16_t*, uint16_t*) {
  MissingTier(__func__, "avx512bf16");
}
void CopyBf16(const uint16_t*, int64_t, int64_t, int64_t, int64_t, bool, uint16_t*, int64_t) { MissingTier(__func__, "avx512bf16"); }
void ConvertRowsBf16(const float*, int64_t, int64_t, int64_t, int64_t, uint16_t*, int64_t) { MissingTier(__func__, "avx512bf16"); }
void PackVnniFromBf16Block(const uint16_t*, int64_t, uint16_t*) { MissingTier(__func__, "avx512bf16"); }
void TransposeBf16(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t) { MissingTier(__func__, "avx512bf16"); }
void ColumnDotsBf16(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t) {
  MissingTier(__func__, "avx512bf16");
}
#endif
#ifndef TOKAMAX_HAVE_AMX
AmxTileScope::AmxTileScope() { MissingTier(__func__, "amx"); }
AmxTileScope::~AmxTileScope() { MissingTier(__func__, "amx"); }
#endif

}  // namespace tokamax
