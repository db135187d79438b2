// ISA tiers. Each tier's kernels live in their own translation unit built with that tier's flags;
// the tier is chosen at run time from the CPU's features, or forced with TOKAMAX_CPU_ISA.
#pragma once

#include <string>

#include "csrc/core/cpu_info.h"
#include "csrc/core/status.h"

namespace tokamax {

// kAmx is avx512 plus the AMX tile unit for bf16 products (AVX-512BW/BF16, AMX-TILE/BF16, and
// the OS's permission for the tile data state, requested once per process on first query).
// Ops without an AMX path run their avx512 kernels on it.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

const char* IsaName(Isa isa);
bool IsaSupported(Isa isa, const CpuInfo& info);
Isa BestIsa(const CpuInfo& info);

// The tier kernels use now: TOKAMAX_CPU_ISA (read on every call, so tests can switch it) when
// set, else the best supported one. A forced tier the CPU lacks, or an unknown name, is an error.
Status ActiveIsa(Isa* isa);

}  // namespace tokamax
