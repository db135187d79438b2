// Declaring what a tiered source defines, from the untiered code that dispatches to it.
// TOKAMAX_DECLARE_IN_TIERS(decl) declares `decl` in every tier's namespace (tier_scalar,
// tier_avx2, tier_avx512, tier_avx512bf16, tier_amx); only tiers the build compiled
// (TOKAMAX_HAVE_<TIER>, IsaBuilt) may be referenced, so a dispatcher guards each use:
//
//   TOKAMAX_DECLARE_IN_TIERS(const SoftmaxKernels& SoftmaxKernelTable();)
//   #ifdef TOKAMAX_HAVE_AVX2
//     case Isa::kAvx2: return tier_avx2::SoftmaxKernelTable();
//   #endif
//
// Most kernels only need the vector width, so one dispatcher serves them all:
// TOKAMAX_RETURN_BY_VECTOR_WIDTH(isa, Fn(args)) returns tier_avx512::Fn(args) on every
// AVX-512 tier (avx512, avx512bf16, amx), tier_avx2::Fn(args) on avx2, and tier_scalar's
// otherwise, including a tier this build did not compile.
#pragma once

#include "csrc/core/runtime/isa.h"

#define TOKAMAX_DECLARE_IN_TIERS(...)        \
  namespace tier_scalar { __VA_ARGS__ }      \
  namespace tier_avx2 { __VA_ARGS__ }        \
  namespace tier_avx512 { __VA_ARGS__ }      \
  namespace tier_avx512bf16 { __VA_ARGS__ }  \
  namespace tier_amx { __VA_ARGS__ }

#ifdef TOKAMAX_HAVE_AVX512
#define TOKAMAX_IF_HAVE_AVX512(...) __VA_ARGS__
#else
#define TOKAMAX_IF_HAVE_AVX512(...)
#endif
#ifdef TOKAMAX_HAVE_AVX2
#define TOKAMAX_IF_HAVE_AVX2(...) __VA_ARGS__
#else
#define TOKAMAX_IF_HAVE_AVX2(...)
#endif

#define TOKAMAX_RETURN_BY_VECTOR_WIDTH(isa, ...)                                          \
  switch (isa) {                                                                         \
    TOKAMAX_IF_HAVE_AVX512(case ::tokamax::Isa::kAvx512 : case ::tokamax::Isa::kAvx512Bf16 \
                           : case ::tokamax::Isa::kAmx : return tier_avx512::__VA_ARGS__;)   \
    TOKAMAX_IF_HAVE_AVX2(case ::tokamax::Isa::kAvx2 : return tier_avx2::__VA_ARGS__;)        \
    default: break;                                                                      \
  }                                                                                      \
  return tier_scalar::__VA_ARGS__
