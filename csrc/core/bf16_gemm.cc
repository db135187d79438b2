// Which bf16 product engine a tier runs, and the per-thread state it needs.
#include "csrc/core/bf16_gemm.h"

#include "csrc/core/amx_gemm.h"

namespace tokamax {

Bf16Products GetBf16Products(Isa isa) {
  Bf16Products products;
  if (isa == Isa::kAmx) {
    products.gemm = AmxGemmBf16;
    products.tile_unit = true;
  } else if (isa == Isa::kAvx512Bf16) {
    products.gemm = DotGemmBf16;
  }
  return products;
}

Bf16ProductScope::Bf16ProductScope(const Bf16Products& products) {
  if (products.tile_unit) tiles_.reset(new AmxTileScope());
}

Bf16ProductScope::~Bf16ProductScope() = default;

}  // namespace tokamax
