#include "csrc/core/runtime/isa.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace tokamax {
namespace {

// Linux keeps the AMX tile data state (XTILEDATA, 8 KiB per thread) off until a process asks
// for it; without the grant the first tile instruction faults. Asked once, process-wide.
bool TileDataPermitted() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAmx: return "amx";
  }
  return "unknown";
}

bool IsaSupported(Isa isa, const CpuInfo& info) {
  if (!IsaBuilt(isa)) return false;
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return info.avx2 && info.fma && info.f16c;
    case Isa::kAvx512: return IsaSupported(Isa::kAvx2, info) && info.avx512f;
    case Isa::kAvx512Bf16: return IsaSupported(Isa::kAvx512, info) && info.avx512bw && info.avx512vl && info.avx512bf16;
    case Isa::kAmx:
      return IsaSupported(Isa::kAvx512Bf16, info) && info.amx_tile && info.amx_bf16 && TileDataPermitted();
  }
  return false;
}

Isa BestIsa(const CpuInfo& info) {
  if (IsaSupported(Isa::kAmx, info)) return Isa::kAmx;
  if (IsaSupported(Isa::kAvx512Bf16, info)) return Isa::kAvx512Bf16;
  if (IsaSupported(Isa::kAvx512, info)) return Isa::kAvx512;
  return IsaSupported(Isa::kAvx2, info) ? Isa::kAvx2 : Isa::kScalar;
}

Status ActiveIsa(Isa* isa) {
  const CpuInfo& info = GetCpuInfo();
  const char* forced = std::getenv("TOKAMAX_CPU_ISA");
  if (forced == nullptr || forced[0] == '\0') {
    *isa = BestIsa(info);
    return Status::Ok();
  }
  for (Isa candidate : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx}) {
    if (std::strcmp(forced, IsaName(candidate)) != 0) continue;
    if (!IsaBuilt(candidate)) {
      return Status::Error(std::string("TOKAMAX_CPU_ISA=") + forced +
                           ": this build has no such tier (only x86-64 builds the avx2, avx512, avx512bf16 and amx tiers)");
    }
    if (!IsaSupported(candidate, info)) {
      return Status::Error(std::string("TOKAMAX_CPU_ISA=") + forced +
                           " is not supported by this CPU (avx2 needs AVX2, FMA and F16C; avx512 also AVX-512F; avx512bf16 also AVX-512BW/VL/BF16; amx also AMX-TILE/BF16 and the OS tile state)");
    }
    *isa = candidate;
    return Status::Ok();
  }
  return Status::Error(std::string("TOKAMAX_CPU_ISA: expected one of 'scalar', 'avx2', 'avx512', 'avx512bf16', 'amx', got '") +
                       forced + "'");
}

}  // namespace tokamax
