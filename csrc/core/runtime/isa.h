// ISA tiers. Each tier's kernels live in their own translation unit built with that tier's flags;
// the tier is chosen at run time from the CPU's features, or forced with TOKAMAX_CPU_ISA.
#pragma once

#include <string>

#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/base/status.h"

namespace tokamax {

// kAvx512Bf16 is avx512 plus bf16 products on the AVX512-BF16 dot instruction (AVX-512BW/VL/
// BF16: Zen 4 and later, Cooper Lake). kAmx is that plus the AMX tile unit for the products
// (AMX-TILE/BF16, and the OS's permission for the tile data state, requested once per process
// on first query). Both share the bf16 operand format (bf16_gemm.h); ops without a bf16
// product path run their avx512 kernels on them.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

// Whether this build compiled the tier's translation units. CMake defines TOKAMAX_HAVE_AVX2,
// TOKAMAX_HAVE_AVX512, TOKAMAX_HAVE_AVX512BF16 and TOKAMAX_HAVE_AMX for the tiers it builds
// (all four on x86-64, none elsewhere; scalar always). The per-tier tables are reached only
// through IsaSupported, which is false for a tier not built.
constexpr bool IsaBuilt(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
#ifdef TOKAMAX_HAVE_AVX2
    case Isa::kAvx2: return true;
#endif
#ifdef TOKAMAX_HAVE_AVX512
    case Isa::kAvx512: return true;
#endif
#ifdef TOKAMAX_HAVE_AVX512BF16
    case Isa::kAvx512Bf16: return true;
#endif
#ifdef TOKAMAX_HAVE_AMX
    case Isa::kAmx: return true;
#endif
    default: return false;
  }
}

const char* IsaName(Isa isa);
// Built here and runnable on this CPU.
bool IsaSupported(Isa isa, const CpuInfo& info);
Isa BestIsa(const CpuInfo& info);

// The tier kernels use now: TOKAMAX_CPU_ISA (read on every call, so tests can switch it) when
// set, else the best supported one. A forced tier the CPU lacks, or an unknown name, is an error.
Status ActiveIsa(Isa* isa);

}  // namespace tokamax
