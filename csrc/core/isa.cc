#include "csrc/core/isa.h"

#include <cstdlib>
#include <cstring>

namespace tokamax {

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

bool IsaSupported(Isa isa, const CpuInfo& info) {
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return info.avx2 && info.fma && info.f16c;
    case Isa::kAvx512: return IsaSupported(Isa::kAvx2, info) && info.avx512f;
  }
  return false;
}

Isa BestIsa(const CpuInfo& info) {
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
  for (Isa candidate : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (std::strcmp(forced, IsaName(candidate)) != 0) continue;
    if (!IsaSupported(candidate, info)) {
      return Status::Error(std::string("TOKAMAX_CPU_ISA=") + forced +
                           " is not supported by this CPU (avx2 needs AVX2, FMA and F16C; avx512 also AVX-512F)");
    }
    *isa = candidate;
    return Status::Ok();
  }
  return Status::Error(std::string("TOKAMAX_CPU_ISA: expected one of 'scalar', 'avx2', 'avx512', got '") +
                       forced + "'");
}

}  // namespace tokamax
