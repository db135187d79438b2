// The gated linear unit backward's elementwise pass on the vector layer: for one row,
// dgate = dout · up · activation'(gate) and dup = dout · activation(gate), in fp32, for
// contiguous rows of fp32, bf16 or fp16 (gated_linear_unit.cc calls it per row).
// tokamax-tiers: scalar avx2 avx512
#include "csrc/core/vec/vec.h"

#include <algorithm>
#include <cmath>

#include "csrc/core/gemm/gemm.h"
#include "csrc/ops/gated_linear_unit/gated_linear_unit.h"

namespace tokamax {
namespace TOKAMAX_TIER_NAMESPACE {
namespace {

#include "csrc/core/gemm/activation_lanes.inc"

template <typename T, Activation kActivation>
void RowGrads(const void* dout_p, const void* gate_p, const void* up_p, void* dgate_p, void* dup_p, int64_t n) {
  const T* dout = static_cast<const T*>(dout_p);
  const T* gate = static_cast<const T*>(gate_p);
  const T* up = static_cast<const T*>(up_p);
  T* dgate = static_cast<T*>(dgate_p);
  T* dup = static_cast<T*>(dup_p);
  int64_t j = 0;
  if constexpr (kVectorDerivative<kActivation>) {
    for (; j + kLanes <= n; j += kLanes) {
      const Vec dy = LoadWiden(dout + j), u = LoadWiden(up + j);
      Vec activated, derivative;
      ActivationAndDerivativeLanes<kActivation>(LoadWiden(gate + j), &activated, &derivative);
      StoreNarrow(dgate + j, Mul(Mul(dy, u), derivative));
      StoreNarrow(dup + j, Mul(dy, activated));
    }
  }
  for (; j < n; ++j) {  // the rest, and the activations without a vector derivative
    const float dy = LoadAsFloat(dout + j), g = LoadAsFloat(gate + j), u = LoadAsFloat(up + j);
    StoreFromFloat(dgate + j, dy * u * ActivationDerivative(kActivation, g));
    StoreFromFloat(dup + j, dy * Activate(kActivation, g));
  }
}

template <typename T>
GluRowGradsFn RowGradsFor(Activation activation) {
  switch (activation) {
    case Activation::kNone: return &RowGrads<T, Activation::kNone>;
    case Activation::kRelu: return &RowGrads<T, Activation::kRelu>;
    case Activation::kSilu: return &RowGrads<T, Activation::kSilu>;
    case Activation::kGeluTanh: return &RowGrads<T, Activation::kGeluTanh>;
    case Activation::kGeluErf: return &RowGrads<T, Activation::kGeluErf>;
    case Activation::kSigmoid: return &RowGrads<T, Activation::kSigmoid>;
  }
  return nullptr;
}

}  // namespace

GluRowGradsFn GluRowGrads(DType dtype, Activation activation) {
  switch (dtype) {
    case DType::kFloat32: return RowGradsFor<float>(activation);
    case DType::kBFloat16: return RowGradsFor<BFloat16Bits>(activation);
    case DType::kFloat16: return RowGradsFor<Float16Bits>(activation);
    case DType::kFloat64: break;  // the exact double loop of gated_linear_unit.cc
  }
  return nullptr;
}

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
