// Micro-benchmark of the ragged_dot core without torch: prints GFLOP/s of the forward product
// on one thread (or two with --threads=2) for a given shape. Not part of the test suite.
//   ragged_dot_bench M K N G [dtype: f32|bf16] [threads] [config fields in order, "-" for the heuristic's]
// G written zG (z128) gives G groups of Zipf-distributed sizes (size of group i ~ 1 / (i + 1), the
// MoE case of issue 22) instead of equal ones. TOKAMAX_BENCH_FORM=trans|contract times the lhs
// gradient's (TRANS_RHS) or the rhs gradient's (RAGGED_CONTRACTING) product of the same call.
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
  const bool zipf = argc > 4 && argv[4][0] == 'z';
  const int64_t g = argc > 4 ? std::atoll(argv[4] + (zipf ? 1 : 0)) : 8;
  const char* form_env = std::getenv("TOKAMAX_BENCH_FORM");
  const std::string form_name = form_env != nullptr ? form_env : "";
  const RaggedDotForm form = form_name == "trans"      ? RaggedDotForm::kTransRhs
                             : form_name == "contract" ? RaggedDotForm::kRaggedContracting
                                                       : RaggedDotForm::kDefault;
  const DType dtype = argc > 5 && std::string(argv[5]) == "bf16" ? DType::kBFloat16 : DType::kFloat32;
  const int threads = argc > 6 ? std::atoi(argv[6]) : 1;
  if (threads == 2) SetParallelBackend(&testing::TwoThreadBackend);
  // The product of lhs[M, K] and rhs[G, K, N] in the chosen form: its own operands, same FLOPs.
  const bool contract = form == RaggedDotForm::kRaggedContracting;
  const int64_t out_elements = contract ? g * k * n : m * n;
  testing::Buffer lhs(dtype, m * k), rhs(dtype, contract ? m * n : g * k * n), out(dtype, out_elements);
  testing::FillRandom(lhs, m * k, 1);
  testing::FillRandom(rhs, contract ? m * n : g * k * n, 2);
  std::vector<int64_t> sizes(g, m / g);
  if (zipf) {
    double total = 0;
    for (int64_t i = 0; i < g; ++i) total += 1.0 / (i + 1);
    int64_t used = 0;
    for (int64_t i = 0; i < g; ++i) used += sizes[i] = static_cast<int64_t>(m / (i + 1) / total);
    sizes[0] += m - used;
  }
  RaggedDotParams p;
  p.form = form;
  p.lhs = {lhs.data(), dtype, {m, k, 0}, {k, 1, 0}};
  if (form == RaggedDotForm::kDefault) p.rhs = {rhs.data(), dtype, {g, k, n}, {k * n, n, 1}};
  if (form == RaggedDotForm::kTransRhs) p.rhs = {rhs.data(), dtype, {g, n, k}, {k * n, k, 1}};
  if (contract) p.rhs = {rhs.data(), dtype, {m, n, 0}, {n, 1, 0}};
  p.group_sizes = sizes.data();
  p.num_groups = g;
  p.out = out.data();
  p.out_dtype = dtype;
  p.out_strides[0] = contract ? k * n : n;
  p.out_strides[1] = contract ? n : 1;
  p.out_strides[2] = 1;
  RaggedDotConfig config = RaggedDotHeuristicConfig({form, m, k, n, g}, dtype, GetCpuInfo(), RaggedDotProduct::kForward);
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
  const int reps = std::getenv("TOKAMAX_BENCH_REPS") ? std::atoi(std::getenv("TOKAMAX_BENCH_REPS")) : 5;
  for (int rep = 0; rep < reps; ++rep) {
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
