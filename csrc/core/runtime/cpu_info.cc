#include "csrc/core/runtime/cpu_info.h"

#include <unistd.h>

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace tokamax {
namespace {

int64_t CacheSizeOr(int name, int64_t fallback) {
  const long value = sysconf(name);
  return value > 0 ? static_cast<int64_t>(value) : fallback;
}

CpuInfo Detect() {
  CpuInfo info;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  info.avx2 = __builtin_cpu_supports("avx2");
  info.fma = __builtin_cpu_supports("fma");
  info.avx512f = __builtin_cpu_supports("avx512f");
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx)) {
    char vendor[13] = {};
    std::memcpy(vendor + 0, &ebx, 4);
    std::memcpy(vendor + 4, &edx, 4);
    std::memcpy(vendor + 8, &ecx, 4);
    if (std::strcmp(vendor, "AuthenticAMD") == 0) info.vendor = "amd";
    else if (std::strcmp(vendor, "GenuineIntel") == 0) info.vendor = "intel";
    else info.vendor = "unknown";
  }
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    info.avx512bw = info.avx512f && (ebx & (1u << 30)) != 0;
    info.avx512vl = info.avx512f && (ebx & (1u << 31)) != 0;
    info.amx_bf16 = (edx & (1u << 22)) != 0;
    info.amx_tile = (edx & (1u << 24)) != 0;
    if (eax >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) info.avx512bf16 = info.avx512f && (eax & (1u << 5)) != 0;
  }
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
    info.f16c = (ecx & bit_F16C) != 0;
    const int base_family = (eax >> 8) & 0xf;
    const int base_model = (eax >> 4) & 0xf;
    const int ext_family = (eax >> 20) & 0xff;
    const int ext_model = (eax >> 16) & 0xf;
    info.family = base_family == 0xf ? base_family + ext_family : base_family;
    info.model = (base_family == 0x6 || base_family == 0xf) ? (ext_model << 4) + base_model : base_model;
  }
#elif defined(__aarch64__)
  info.vendor = "arm";
#else
  info.vendor = "unknown";
#endif
#ifdef _SC_LEVEL1_DCACHE_SIZE
  info.l1d_bytes = CacheSizeOr(_SC_LEVEL1_DCACHE_SIZE, info.l1d_bytes);
  info.l2_bytes = CacheSizeOr(_SC_LEVEL2_CACHE_SIZE, info.l2_bytes);
  info.l3_bytes = CacheSizeOr(_SC_LEVEL3_CACHE_SIZE, info.l3_bytes);
#endif
  return info;
}

}  // namespace

const CpuInfo& GetCpuInfo() {
  static const CpuInfo info = Detect();
  return info;
}

std::string MicroarchitectureName(const CpuInfo& info) {
  if (info.vendor == "amd") {
    // Family 0x17 is Zen 1/2, 0x19 is Zen 3 (models 0x00-0x0f, 0x20-0x5f) or Zen 4 (0x10-0x1f,
    // 0x60-0x7f, 0xa0-0xaf), 0x1a is Zen 5.
    if (info.family == 0x17) return info.model >= 0x30 ? "zen2" : "zen1";
    if (info.family == 0x19) {
      const int m = info.model;
      const bool zen4 = (m >= 0x10 && m <= 0x1f) || (m >= 0x60 && m <= 0x7f) || (m >= 0xa0 && m <= 0xaf);
      return zen4 ? "zen4" : "zen3";
    }
    if (info.family == 0x1a) return "zen5";
    return "family" + std::to_string(info.family);
  }
  if (info.vendor == "intel") {
    if (info.family != 6) return "family" + std::to_string(info.family);
    switch (info.model) {
      case 0x3c: case 0x3f: case 0x45: case 0x46: return "haswell";
      case 0x3d: case 0x47: case 0x4f: case 0x56: return "broadwell";
      case 0x4e: case 0x5e: case 0x8e: case 0x9e: case 0xa5: case 0xa6: return "skylake";
      case 0x55: return info.avx512f ? "skylakex" : "skylake";
      case 0x6a: case 0x6c: return "icelake";
      case 0x8f: return "sapphirerapids";
      case 0xcf: return "emeraldrapids";
      case 0xad: case 0xae: return "graniterapids";
      case 0x97: case 0x9a: case 0xb7: case 0xba: case 0xbf: return "alderlake";
      default: return "model" + std::to_string(info.model);
    }
  }
  if (info.vendor == "arm") return "aarch64";
  return "unknown";
}

}  // namespace tokamax
