// Micro-benchmark of the ragged_dot core without torch: prints GFLOP/s of the forward product
// on one thread (or two with --threads=2) for a given shape. Not part of the test suite.
//   ragged_dot_bench M K N G [dtype: f32|bf16] [threads] [config fields in order, "-" for the heuristic's]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/runtime/cpu_info.h"
#include "csrc/core/runtime/parallel.h"
#include "csrc/core/base/test_util.h"
#include "csrc/ops/ragged_dot/ragged_dot.h"

int main(int argc, char** argv) {
  using namespace tokamax;
  const int64_t m = argc > 1 ? std::atoll(argv[1]) : 8192;
  const int64_t k = argc > 2 ? std::atoll(argv[2]) : 1024;
  const int64_t n = argc > 3 ? std::atoll(argv[3]) : 1024;
  const int64_t g = argc > 4 ? std::atoll(argv[4]) : 8;
  const DType dtype = argc > 5 && std::string(argv[5]) == "bf16" ? DType::kBFloat16 : DType::kFloat32;
  const int threads = argc > 6 ? std::atoi(argv[6]) : 1;
  if (threads == 2) SetParallelBackend(&testing::TwoThreadBackend);
  testing::Buffer lhs(dtype, m * k), rhs(dtype, g * k * n), out(dtype, m * n);
  testing::FillRandom(lhs, m * k, 1);
  testing::FillRandom(rhs, g * k * n, 2);
  std::vector<int64_t> sizes(g, m / g);
  RaggedDotParams p;
  p.lhs = {lhs.data(), dtype, {m, k, 0}, {k, 1, 0}};
  p.rhs = {rhs.data(), dtype, {g, k, n}, {k * n, n, 1}};
  p.group_sizes = sizes.data();
  p.num_groups = g;
  p.out = out.data();
  p.out_dtype = dtype;
  p.out_strides[0] = n;
  p.out_strides[1] = 1;
  RaggedDotConfig config =
      RaggedDotHeuristicConfig({RaggedDotForm::kDefault, m, k, n, g}, dtype, GetCpuInfo(), RaggedDotProduct::kForward);
  // Optional overrides after the thread count, in field order ("-" keeps the heuristic's value).
  std::vector<int64_t> values = config.ToVector();
  for (int i = 0; i < RaggedDotConfig::kNumFields && 7 + i < argc; ++i) {
    if (std::string(argv[7 + i]) != "-") values[i] = std::atoll(argv[7 + i]);
  }
  const Status parsed = RaggedDotConfig::FromVector(values, &config);
  if (!parsed.ok()) { std::fprintf(stderr, "%s\n", parsed.message().c_str()); return 1; }
  std::printf("config");
  for (int i = 0; i < RaggedDotConfig::kNumFields; ++i) {
    std::printf(" %s=%lld", RaggedDotConfig::kFields[i].name, (long long)values[i]);
  }
  std::printf("\n");
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = RaggedDot(p, config);
    const auto t1 = std::chrono::steady_clock::now();
    if (!s.ok()) { std::fprintf(stderr, "%s\n", s.message().c_str()); return 1; }
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  std::printf("M=%lld K=%lld N=%lld G=%lld %s threads=%d: %.3f ms, %.1f GFLOP/s\n", (long long)m,
              (long long)k, (long long)n, (long long)g, DTypeName(dtype), threads, best * 1e3,
              2.0 * m * k * n / best * 1e-9);
  return 0;
}
