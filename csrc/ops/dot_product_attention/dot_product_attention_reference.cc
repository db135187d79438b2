// dot_product_attention in plain float64 loops: the oracle of the C++ tests and the float64
// path of the kernels (gradcheck). One query row at a time, O(S) scratch, no T x S buffer.
#include <cmath>
#include <limits>
#include <vector>

#include "csrc/ops/dot_product_attention/attention_masks.h"
#include "csrc/ops/dot_product_attention/dot_product_attention.h"

namespace tokamax {
namespace {

using attention::LoadElementDouble;
using attention::StoreElementDouble;

struct Dims {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim, value_dim;
};

Dims DimsOf(const DotProductAttentionParams& p) {
  return {p.q.sizes[0], p.q.sizes[1], p.k.sizes[1], p.q.sizes[2], p.k.sizes[2], p.q.sizes[3], p.v.sizes[3]};
}

// Softmax probabilities of query (b, n, t) over all keys; returns false when no key is visible.
// pre_cap holds the logits before soft-capping (for its derivative).
bool RowProbabilities(const DotProductAttentionParams& p, const Dims& d, int64_t b, int64_t n, int64_t t,
                      std::vector<double>* probs, std::vector<double>* capped_tanh, double* lse) {
  const int64_t kh = n / (d.q_heads / d.kv_heads);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  double max = neg_inf;
  for (int64_t s = 0; s < d.kv_len; ++s) {
    (*probs)[s] = neg_inf;
    (*capped_tanh)[s] = 0.0;
    if (!attention::Visible(p.masks, b, n, t, s, d.kv_len)) continue;
    double dot = 0.0;
    for (int64_t h = 0; h < d.head_dim; ++h) {
      dot += LoadElementDouble(p.q, b, t, n, h) * LoadElementDouble(p.k, b, s, kh, h);
    }
    double logit = p.scale * dot;
    if (p.bias.data != nullptr) logit += LoadElementDouble(p.bias, b, n, t, s);
    if (p.logits_soft_cap > 0.0f) {
      const double th = std::tanh(logit / p.logits_soft_cap);
      (*capped_tanh)[s] = th;
      logit = p.logits_soft_cap * th;
    }
    (*probs)[s] = logit;
    max = std::max(max, logit);
  }
  if (max == neg_inf) {
    for (int64_t s = 0; s < d.kv_len; ++s) (*probs)[s] = 0.0;
    *lse = neg_inf;
    return false;
  }
  double sum = 0.0;
  for (int64_t s = 0; s < d.kv_len; ++s) {
    (*probs)[s] = (*probs)[s] == neg_inf ? 0.0 : std::exp((*probs)[s] - max);
    sum += (*probs)[s];
  }
  for (int64_t s = 0; s < d.kv_len; ++s) (*probs)[s] /= sum;
  *lse = max + std::log(sum);
  return true;
}

}  // namespace

void DotProductAttentionReference(const DotProductAttentionParams& p) {
  const Dims d = DimsOf(p);
  const int64_t group = d.q_heads / d.kv_heads;
  std::vector<double> probs(d.kv_len), tanh_values(d.kv_len);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t n = 0; n < d.q_heads; ++n) {
      for (int64_t t = 0; t < d.q_len; ++t) {
        double lse;
        RowProbabilities(p, d, b, n, t, &probs, &tanh_values, &lse);
        for (int64_t e = 0; e < d.value_dim; ++e) {
          double acc = 0.0;
          for (int64_t s = 0; s < d.kv_len; ++s) {
            if (probs[s] != 0.0) acc += probs[s] * LoadElementDouble(p.v, b, s, n / group, e);
          }
          StoreElementDouble(p.out, b, t, n, e, acc);
        }
        if (p.lse != nullptr) {
          const int64_t offset = b * p.lse_strides[0] + n * p.lse_strides[1] + t * p.lse_strides[2];
          if (p.q.dtype == DType::kFloat64) {
            static_cast<double*>(p.lse)[offset] = lse;
          } else {
            static_cast<float*>(p.lse)[offset] = static_cast<float>(lse);
          }
        }
      }
    }
  }
}

void DotProductAttentionBackwardReference(const DotProductAttentionGradParams& g) {
  const DotProductAttentionParams& p = g.forward;
  const Dims d = DimsOf(p);
  const int64_t group = d.q_heads / d.kv_heads;
  std::vector<double> dk(d.batch * d.kv_len * d.kv_heads * d.head_dim, 0.0);
  std::vector<double> dv(d.batch * d.kv_len * d.kv_heads * d.value_dim, 0.0);
  std::vector<double> probs(d.kv_len), tanh_values(d.kv_len), dlogits(d.kv_len), dq(d.head_dim);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t n = 0; n < d.q_heads; ++n) {
      const int64_t kh = n / group;
      for (int64_t t = 0; t < d.q_len; ++t) {
        double lse;
        const bool any = RowProbabilities(p, d, b, n, t, &probs, &tanh_values, &lse);
        // dP_s = dO · v_s; dlogit_s = P_s (dP_s - sum_s' P_s' dP_s' + dlse).
        double dlse = 0.0;
        if (g.dlse != nullptr) {
          const int64_t offset = b * g.dlse_strides[0] + n * g.dlse_strides[1] + t * g.dlse_strides[2];
          dlse = p.q.dtype == DType::kFloat64 ? static_cast<const double*>(g.dlse)[offset]
                                              : static_cast<const float*>(g.dlse)[offset];
        }
        double weighted = 0.0;
        for (int64_t s = 0; s < d.kv_len; ++s) {
          dlogits[s] = 0.0;
          if (probs[s] == 0.0) continue;
          double dp = 0.0;
          for (int64_t e = 0; e < d.value_dim; ++e) {
            const double dout = LoadElementDouble(g.dout, b, t, n, e);
            dp += dout * LoadElementDouble(p.v, b, s, kh, e);
            dv[((b * d.kv_len + s) * d.kv_heads + kh) * d.value_dim + e] += probs[s] * dout;
          }
          dlogits[s] = dp;
          weighted += probs[s] * dp;
        }
        for (int64_t h = 0; h < d.head_dim; ++h) dq[h] = 0.0;
        for (int64_t s = 0; s < d.kv_len; ++s) {
          double ds = any ? probs[s] * (dlogits[s] - weighted + dlse) : 0.0;
          if (p.logits_soft_cap > 0.0f) ds *= 1.0 - tanh_values[s] * tanh_values[s];
          if (g.dbias != nullptr) {
            // Summing the batches, batch 0 writes every element and the later ones add to it.
            const bool add = g.dbias_sum_batches && b > 0;
            const int64_t offset = (((g.dbias_sum_batches ? 0 : b) * d.q_heads + n) * d.q_len + t) * d.kv_len + s;
            if (p.q.dtype == DType::kFloat64) {
              double& dst = static_cast<double*>(g.dbias)[offset];
              dst = add ? dst + ds : ds;
            } else {
              float& dst = static_cast<float*>(g.dbias)[offset];
              dst = add ? dst + static_cast<float>(ds) : static_cast<float>(ds);
            }
          }
          if (ds == 0.0) continue;
          for (int64_t h = 0; h < d.head_dim; ++h) {
            dq[h] += p.scale * ds * LoadElementDouble(p.k, b, s, kh, h);
            dk[((b * d.kv_len + s) * d.kv_heads + kh) * d.head_dim + h] += p.scale * ds * LoadElementDouble(p.q, b, t, n, h);
          }
        }
        for (int64_t h = 0; h < d.head_dim; ++h) StoreElementDouble(g.dq, b, t, n, h, dq[h]);
      }
    }
  }
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t s = 0; s < d.kv_len; ++s) {
      for (int64_t kh = 0; kh < d.kv_heads; ++kh) {
        for (int64_t h = 0; h < d.head_dim; ++h) {
          StoreElementDouble(g.dk, b, s, kh, h, dk[((b * d.kv_len + s) * d.kv_heads + kh) * d.head_dim + h]);
        }
        for (int64_t e = 0; e < d.value_dim; ++e) {
          StoreElementDouble(g.dv, b, s, kh, e, dv[((b * d.kv_len + s) * d.kv_heads + kh) * d.value_dim + e]);
        }
      }
    }
  }
}

}  // namespace tokamax
