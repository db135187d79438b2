// Declaring what a tiered source defines, from the untiered code that dispatches to it.
// TOKAMAX_DECLARE_IN_TIERS(decl) declares `decl` in every tier's namespace (tier_scalar,
// tier_avx2, tier_avx512, tier_avx512bf16, tier_amx); only tiers the build compiled
// (TOKAMAX_HAVE_<TIER>, IsaBuilt) may be referenced, so a dispatcher guards each use:
//
//   TOKAMAX_DECLARE_IN_TIERS(const SoftmaxKernels& SoftmaxKernelTable();)
//   #ifdef TOKAMAX_HAVE_AVX2
//     case Isa::kAvx2: return tier_avx2::SoftmaxKernelTable();
//   #endif
#pragma once

#define TOKAMAX_DECLARE_IN_TIERS(...)        \
  namespace tier_scalar { __VA_ARGS__ }      \
  namespace tier_avx2 { __VA_ARGS__ }        \
  namespace tier_avx512 { __VA_ARGS__ }      \
  namespace tier_avx512bf16 { __VA_ARGS__ }  \
  namespace tier_amx { __VA_ARGS__ }
