#include "csrc/ops/dot_product_attention/attention_row_products.h"

#include "csrc/core/vec/tiers.h"

namespace tokamax {

TOKAMAX_DECLARE_IN_TIERS(const attention::RowProducts& RowProductsTable();)

namespace attention {

// A tier this build lacks (IsaBuilt) gets the scalar table. The amx tier keeps the widening
// row products: on the Intel VM it was measured on, vdpbf16ps ran at half the FMA's rate per
// multiply-add, and the dot version was slower.
const RowProducts& GetRowProducts(Isa isa) {
  switch (isa) {
#ifdef TOKAMAX_HAVE_AVX512BF16
    case Isa::kAvx512Bf16: return tier_avx512bf16::RowProductsTable();
#endif
#ifdef TOKAMAX_HAVE_AVX512
    case Isa::kAvx512:
    case Isa::kAmx: return tier_avx512::RowProductsTable();
#endif
#ifdef TOKAMAX_HAVE_AVX2
    case Isa::kAvx2: return tier_avx2::RowProductsTable();
#endif
    default: break;
  }
  return tier_scalar::RowProductsTable();
}

}  // namespace attention
}  // namespace tokamax
