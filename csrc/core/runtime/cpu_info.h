// What the CPU can do and how big its caches are, detected once per process.
#pragma once

#include <cstdint>
#include <string>

namespace tokamax {

struct CpuInfo {
  std::string vendor;          // "amd", "intel", "arm" or "unknown"
  int family = 0;              // x86 display family (e.g. 25 for Zen 3/4)
  int model = 0;               // x86 display model
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512bf16 = false;
  bool amx_tile = false;  // the CPU's; the OS must also grant the tile state (isa.h)
  bool amx_bf16 = false;
  int64_t l1d_bytes = 32 * 1024;
  int64_t l2_bytes = 512 * 1024;
  int64_t l3_bytes = 32 * 1024 * 1024;
};

// Detected on first use; later calls return the same object.
const CpuInfo& GetCpuInfo();

// Microarchitecture family name, e.g. "zen3", "zen4", "skylake", or "x86" when unknown.
std::string MicroarchitectureName(const CpuInfo& info);

}  // namespace tokamax
