// The amx tier's bf16 product engine (bf16_gemm.h has the contract and the operand format):
// 16 x 16 fp32 tiles of C, 32 bf16 deep per tile instruction, four C tiles (32 x 32) per block.
// Runs only where IsaSupported(Isa::kAmx), inside an AmxTileScope (or a Bf16ProductScope).
#pragma once

#include <cstdint>

#include "csrc/core/gemm/bf16_gemm.h"

namespace tokamax {

// Loads the tile configuration into the calling thread's tile registers for the scope's
// lifetime and releases them at its end. Every AMX call below must run inside one.
class AmxTileScope {
 public:
  AmxTileScope();
  ~AmxTileScope();
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;
};

// Bf16GemmFn on the tile unit.
void AmxGemmBf16(int64_t m, int64_t n, int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b, float* c,
                 int64_t ldc, bool accumulate, float scale);

}  // namespace tokamax
