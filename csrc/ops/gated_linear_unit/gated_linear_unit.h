// gated_linear_unit: out = activation(x · W_gate) · (x · W_up) over the rows of x [M, K] with
// weights [K, N] each. The forward is one gated GEMM (GemmGate, gemm.h): both products share
// one packed pass over x, the activation and the product run in the store, and the [M, 2N]
// pre-activations exist only when asked for (the residuals the backward reads, [M, 2, N] in
// x's dtype). The backward turns dout and the residuals into d(pre-activations) [M, 2N] (one
// elementwise pass), then dx = dpre · W[K, 2N]ᵀ and dW = xᵀ · dpre, two plain GEMMs on the core.
// Sums are fp32 (float64 for float64) in an order fixed by the config and the ISA tier, never
// by the thread count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/base/config_fields.h"
#include "csrc/core/base/dtype.h"
#include "csrc/core/base/status.h"
#include "csrc/core/base/strided_view.h"
#include "csrc/core/gemm/gemm.h"
#include "csrc/core/runtime/cpu_info.h"

namespace tokamax {

#define TOKAMAX_GATED_LINEAR_UNIT_CONFIG_FIELDS(X)                                      \
  X(block_m, 96, 6, 1536, 6, "rows of x packed at once")                               \
  X(block_k, 256, 1, 8192, 1, "depth of one packed slice of K")                          \
  X(block_n, 256, 16, 8192, 16, "output columns per task (the forward packs gate and up: twice as many)") \
  X(task_m, 768, 6, 65536, 1, "rows per parallel task; a multiple of block_m")
#define TOKAMAX_GATED_LINEAR_UNIT_PRODUCTS(X) X(kForward, "forward") X(kBackward, "backward")

struct GatedLinearUnitConfig {
  TOKAMAX_CONFIG_BODY(GatedLinearUnitConfig, "gated_linear_unit", TOKAMAX_GATED_LINEAR_UNIT_CONFIG_FIELDS,
                      TOKAMAX_GATED_LINEAR_UNIT_PRODUCTS)
};
using GatedLinearUnitProduct = GatedLinearUnitConfig::Product;

struct GatedLinearUnitShape {
  int64_t m = 0;  // rows of x (the product of its leading dims)
  int64_t k = 0;
  int64_t n = 0;  // columns of each weight
  // Both weights' columns are contiguous (fused [K, 2, N] or [K, N] weights, not nn.Linear's
  // transposed views): a forward of few rows reads them in place, which wants other blocking.
  bool weights_in_place = true;
};

// The activation named `name` (swish or silu, gelu (tanh approximation), gelu_exact, relu,
// sigmoid, none); an error naming the choices otherwise.
Status ParseGluActivation(const std::string& name, Activation* activation);

// Forward: out [M, N] = activation(x · gate) · (x · up), all in x's dtype; residuals [M, 2, N]
// (gate's then up's pre-activations) written when its data is not null.
struct GatedLinearUnitParams {
  StridedView<2> x;     // [M, K]
  StridedView<2> gate;  // [K, N], any strides (a transposed view reads in place)
  StridedView<2> up;    // [K, N]
  Activation activation = Activation::kSilu;
  MutableStridedView<2> out;        // [M, N]
  MutableStridedView<3> residuals;  // [M, 2, N]; null data: not written
};

// Backward: dpre [M, 2N] = (dgate | dup) from dout and the residuals, then dx [M, K] = dpre ·
// weightsᵀ and dweights [K, 2N] = xᵀ · dpre, each skipped when its data is null. weights [K, 2N]
// holds gate's columns then up's (a fused [K, 2, N] weight, viewed).
struct GatedLinearUnitBackwardParams {
  StridedView<2> dout;       // [M, N]
  StridedView<2> x;          // [M, K]
  StridedView<2> weights;    // [K, 2N]
  StridedView<3> residuals;  // [M, 2, N]
  Activation activation = Activation::kSilu;
  // [M, 2N] working memory, x's dtype (the GEMMs' operand). May be the residuals' own memory
  // (dpre(i, j) at residuals(i, 0, j), dpre(i, N + j) at residuals(i, 1, j)): each element is
  // read before it is written, so the backward then needs no [M, 2N] of its own.
  MutableStridedView<2> dpre;
  MutableStridedView<2> dx;        // [M, K]; null data: not computed
  MutableStridedView<2> dweights;  // [K, 2N]; null data: not computed
};

Status GatedLinearUnit(const GatedLinearUnitParams& params, const GatedLinearUnitConfig& config);
Status GatedLinearUnitBackward(const GatedLinearUnitBackwardParams& params, const GatedLinearUnitConfig& config);

// float64 oracle of the forward (the C++ tests): every sum and activation in double.
void GatedLinearUnitReference(const GatedLinearUnitParams& params);

// d activation(x) / dx (the backward), in float or double.
template <typename T>
inline T ActivationDerivative(Activation activation, T x) {
  switch (activation) {
    case Activation::kNone: return T(1);
    case Activation::kRelu: return x > T(0) ? T(1) : T(0);
    case Activation::kSilu: {
      const T s = T(1) / (T(1) + std::exp(-x));
      return s * (T(1) + x * (T(1) - s));
    }
    case Activation::kSigmoid: {
      const T s = T(1) / (T(1) + std::exp(-x));
      return s * (T(1) - s);
    }
    case Activation::kGeluTanh: {
      const T c = T(0.7978845608028654), a = T(0.044715);
      const T t = std::tanh(c * (x + a * x * x * x));
      return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * c * (T(1) + T(3) * a * x * x);
    }
    case Activation::kGeluErf:
      return T(0.5) * (T(1) + std::erf(x * T(0.7071067811865476))) +
             x * T(0.3989422804014327) * std::exp(T(-0.5) * x * x);
  }
  return T(1);
}

// One contiguous row of the backward's elementwise pass (dout, gate, up -> dgate, dup), n
// elements of one dtype; a tier's version for a dtype and activation (null for float64).
using GluRowGradsFn = void (*)(const void* dout, const void* gate, const void* up, void* dgate, void* dup,
                               int64_t n);

GatedLinearUnitConfig GatedLinearUnitHeuristicConfig(const GatedLinearUnitShape& call, DType dtype,
                                                     const CpuInfo& cpu, GatedLinearUnitProduct product);
std::vector<GatedLinearUnitConfig> GatedLinearUnitConfigSpace(const GatedLinearUnitShape& call, DType dtype,
                                                              const CpuInfo& cpu, GatedLinearUnitProduct product);

}  // namespace tokamax
