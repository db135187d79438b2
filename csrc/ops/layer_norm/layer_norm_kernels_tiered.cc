// The per-row loops of layer_norm (LayerNormKernels), written once over the vector layer
// (csrc/core/vec/vec.h) and compiled once per tier below. A row's sums run over kUnroll vector
// accumulators by column position, then a fixed reduction: the bits depend on the row's length
// and the tier only. The row is read once from memory; the later passes hit L1/L2.
// tokamax-tiers: scalar avx2 avx512
#include "csrc/core/vec/vec.h"

#include "csrc/ops/layer_norm/layer_norm.h"

namespace tokamax {
namespace TOKAMAX_TIER_NAMESPACE {
namespace layer_norm {

constexpr int64_t kUnroll = 4;  // independent accumulators: hides the add latency

inline float Reduce(Vec acc[kUnroll]) {
  return ReduceAdd(Add(Add(acc[0], acc[1]), Add(acc[2], acc[3])));
}

// sum over j < cols of f(j) where f(j) is a Vec of lanes j..j+kLanes and ft(j) the scalar at a
// tail column: full vectors by position, then the tail in order.
template <typename VecFn, typename TailFn>
inline float RowSum(int64_t cols, const VecFn& f, const TailFn& ft) {
  Vec acc[kUnroll] = {Zero(), Zero(), Zero(), Zero()};
  int64_t j = 0;
  for (; j + kUnroll * kLanes <= cols; j += kUnroll * kLanes) {
    for (int64_t u = 0; u < kUnroll; ++u) acc[u] = f(j + u * kLanes, acc[u]);
  }
  for (; j + kLanes <= cols; j += kLanes) acc[0] = f(j, acc[0]);
  float total = Reduce(acc);
  for (; j < cols; ++j) total += ft(j);
  return total;
}

// At the first column of each cache line: the next row's inputs at that column into L2.
template <typename T>
inline void PrefetchNext(const LayerNormNextRow& next, int64_t j) {
  if (j % (64 / static_cast<int64_t>(sizeof(T))) != 0) return;
  for (const void* row : next.inputs) {
    if (row != nullptr) PrefetchToL2(static_cast<const T*>(row) + j);
  }
}

inline Vec LoadOr(const float* p, int64_t j, float absent) { return p ? Load(p + j) : Set1(absent); }
inline float AtOr(const float* p, int64_t j, float absent) { return p ? p[j] : absent; }

template <typename T>
void ForwardRow(const T* x, const T* residual, T* h, T* y, bool stream_y, int64_t cols, const float* w, const float* b,
                float epsilon, bool subtract_mean, float* mean_out, float* rstd_out, const LayerNormNextRow& next) {
  if (residual != nullptr) {  // h = x + residual in fp32, stored in T; the stored h is normalised
    int64_t j = 0;
    for (; j + kLanes <= cols; j += kLanes) StoreNarrow(h + j, Add(LoadWiden(x + j), LoadWiden(residual + j)));
    for (; j < cols; ++j) StoreFromFloat(h + j, LoadAsFloat(x + j) + LoadAsFloat(residual + j));
    x = h;
  }
  const float inv_cols = cols > 0 ? 1.0f / static_cast<float>(cols) : 0.0f;
  float mean = 0.0f;
  if (subtract_mean) {
    mean = inv_cols * RowSum(cols, [&](int64_t j, Vec acc) { return Add(acc, LoadWiden(x + j)); },
                             [&](int64_t j) { return LoadAsFloat(x + j); });
  }
  const Vec m = Set1(mean);
  const float var = inv_cols * RowSum(
      cols, [&](int64_t j, Vec acc) { const Vec d = Sub(LoadWiden(x + j), m); return Fma(d, d, acc); },
      [&](int64_t j) { const float d = LoadAsFloat(x + j) - mean; return d * d; });
  const float rstd = 1.0f / std::sqrt(var + epsilon);
  // y = (x - mean) * rstd * w + b.
  const Vec r = Set1(rstd);
  int64_t j = 0;
  auto store_vectors = [&](auto store) {
    for (; j + kLanes <= cols; j += kLanes) {
      PrefetchNext<T>(next, j);
      const Vec xhat = Mul(Sub(LoadWiden(x + j), m), r);
      store(y + j, Fma(xhat, LoadOr(w, j, 1.0f), LoadOr(b, j, 0.0f)));
    }
  };
  WithNarrowStore(stream_y && StreamAligned(y), store_vectors);
  for (; j < cols; ++j) {
    const float xhat = (LoadAsFloat(x + j) - mean) * rstd;
    StoreFromFloat(y + j, std::fma(xhat, AtOr(w, j, 1.0f), AtOr(b, j, 0.0f)));
  }
  *mean_out = mean;
  *rstd_out = rstd;
}

template <typename T>
void BackwardRow(const T* x, const T* dy, const T* dh, T* dx, T* dresidual, bool stream_dx, int64_t cols, const float* w, float mean,
                 float rstd, bool subtract_mean, float* dscale_acc, float* doffset_acc, const LayerNormNextRow& next) {
  const Vec m = Set1(mean), r = Set1(rstd);
  // Pass 1: the row's sums of g and g * xhat, and the block's dscale/doffset partials.
  Vec sg[kUnroll] = {Zero(), Zero(), Zero(), Zero()};
  Vec sgx[kUnroll] = {Zero(), Zero(), Zero(), Zero()};
  int64_t j = 0;
  auto step = [&](int64_t c, int64_t u) {
    const Vec d = LoadWiden(dy + c);
    const Vec xhat = Mul(Sub(LoadWiden(x + c), m), r);
    const Vec g = w ? Mul(d, Load(w + c)) : d;
    sg[u] = Add(sg[u], g);
    sgx[u] = Fma(g, xhat, sgx[u]);
    if (dscale_acc) Store(dscale_acc + c, Fma(d, xhat, Load(dscale_acc + c)));
    if (doffset_acc) Store(doffset_acc + c, Add(d, Load(doffset_acc + c)));
  };
  for (; j + kUnroll * kLanes <= cols; j += kUnroll * kLanes) {
    for (int64_t u = 0; u < kUnroll; ++u) step(j + u * kLanes, u);
  }
  for (; j + kLanes <= cols; j += kLanes) step(j, 0);
  float sum_g = Reduce(sg), sum_gx = Reduce(sgx);
  for (int64_t c = j; c < cols; ++c) {
    const float d = LoadAsFloat(dy + c);
    const float xhat = (LoadAsFloat(x + c) - mean) * rstd;
    const float g = d * AtOr(w, c, 1.0f);
    sum_g += g;
    sum_gx += g * xhat;
    if (dscale_acc) dscale_acc[c] = std::fma(d, xhat, dscale_acc[c]);
    if (doffset_acc) doffset_acc[c] += d;
  }
  const float inv_cols = 1.0f / static_cast<float>(cols);  // cols > 0: the caller skips empty rows
  const float mg = subtract_mean ? sum_g * inv_cols : 0.0f;
  const float mgx = sum_gx * inv_cols;
  // Pass 2: dx = rstd * (g - mg - xhat * mgx) + dh.
  const Vec vmg = Set1(mg), vmgx = Set1(mgx);
  j = 0;
  auto store_vectors = [&](auto store) {
    for (; j + kLanes <= cols; j += kLanes) {
      PrefetchNext<T>(next, j);
      const Vec d = LoadWiden(dy + j);
      const Vec xhat = Mul(Sub(LoadWiden(x + j), m), r);
      const Vec g = w ? Mul(d, Load(w + j)) : d;
      Vec out = Mul(r, Sub(Sub(g, vmg), Mul(xhat, vmgx)));
      if (dh) out = Add(out, LoadWiden(dh + j));
      store(dx + j, out);
      if (dresidual) store(dresidual + j, out);
    }
  };
  WithNarrowStore(stream_dx && StreamAligned(dx) && (dresidual == nullptr || StreamAligned(dresidual)), store_vectors);
  for (; j < cols; ++j) {
    const float d = LoadAsFloat(dy + j);
    const float xhat = (LoadAsFloat(x + j) - mean) * rstd;
    const float g = d * AtOr(w, j, 1.0f);
    float out = rstd * ((g - mg) - xhat * mgx);
    if (dh) out += LoadAsFloat(dh + j);
    StoreFromFloat(dx + j, out);
    if (dresidual) StoreFromFloat(dresidual + j, out);
  }
}

void ForwardRowAny(DType dtype, const void* x, const void* residual, void* h, void* y, bool stream_y, int64_t cols,
                   const float* w, const float* b, float epsilon, bool subtract_mean, float* mean, float* rstd,
                   const LayerNormNextRow& next) {
  DispatchDType(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      ForwardRow(static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<T*>(h), static_cast<T*>(y),
                 stream_y, cols, w, b, epsilon, subtract_mean, mean, rstd, next);
    }
    return 0;
  });
}

void BackwardRowAny(DType dtype, const void* x, const void* dy, const void* dh, void* dx, void* dresidual,
                    bool stream_dx, int64_t cols, const float* w, float mean, float rstd, bool subtract_mean, float* dscale_acc,
                    float* doffset_acc, const LayerNormNextRow& next) {
  DispatchDType(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      BackwardRow(static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<const T*>(dh), static_cast<T*>(dx),
                  static_cast<T*>(dresidual), stream_dx, cols, w, mean, rstd, subtract_mean, dscale_acc, doffset_acc,
                  next);
    }
    return 0;
  });
}

}  // namespace layer_norm

const LayerNormKernels& LayerNormKernelTable() {
  static const LayerNormKernels kernels{&layer_norm::ForwardRowAny, &layer_norm::BackwardRowAny, &StreamFence};
  return kernels;
}

}  // namespace TOKAMAX_TIER_NAMESPACE
}  // namespace tokamax
