// tokamax::ragged_paged_attention and its reference: the schema (kv_cache donated: Tensor(a!);
// the op returns out and lse, the Python singleton adds kv_cache itself), the one argument check,
// the CPU kernel, the ATen reference (gather the pages, attend, with kv_cache_update's reference
// for the writes), the Meta kernel and the config helper ops. No autograd: it writes state.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "csrc/ops/ragged_paged_attention/ragged_paged_attention.h"
#include "csrc/torch/adapter_utils.h"
#include "csrc/torch/op_kit.h"

namespace tokamax {
namespace {

using at::Tensor;
constexpr const char* kOp = "ragged_paged_attention";

bool IsAttentionFloat(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void CheckIndex(const Tensor& t, const char* name, const char* shape) {
  TORCH_CHECK(t.dim() == 1, kOp, ": ", name, " must be 1-D ", shape, ", got shape ", ShapeString(t));
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, kOp, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
}

// Shapes, dtypes, options and the cache's layout from metadata only (Meta kernels and the config
// ops call it too, so eager and compiled code raise the same errors). Sizes compare symbolically.
std::optional<RaggedPagedAttentionConfig> CheckRaggedPagedAttentionArgs(
    const Tensor& queries, const Tensor& keys, const Tensor& values, const Tensor& kv_cache, const Tensor& kv_lens,
    const Tensor& page_indices, const Tensor& cu_q_lens, const Tensor& distribution,
    std::optional<int64_t> sliding_window = std::nullopt, std::optional<double> soft_cap = std::nullopt,
    std::optional<at::ScalarType> out_dtype = std::nullopt, at::OptionalIntArrayRef config = std::nullopt,
    std::optional<double> sm_scale = std::nullopt, std::optional<double> mask_value = std::nullopt) {
  const auto parsed = ParseOptionalConfig<RaggedPagedAttentionConfig>(config, "config");
  TORCH_CHECK(queries.dim() == 3, kOp, ": queries must be 3-D [T, Hq, D], got shape ", ShapeString(queries));
  TORCH_CHECK(keys.dim() == 3, kOp, ": keys must be 3-D [T, Hkv, D], got shape ", ShapeString(keys));
  TORCH_CHECK(values.dim() == 3, kOp, ": values must be 3-D [T, Hkv, D], got shape ", ShapeString(values));
  TORCH_CHECK(kv_cache.dim() == 4, kOp, ": kv_cache must be 4-D [total_pages, page_size, 2*Hkv, D], got shape ",
              ShapeString(kv_cache));
  CheckIndex(kv_lens, "kv_lens", "[S]");
  CheckIndex(page_indices, "page_indices", "[S * pages_per_seq]");
  CheckIndex(cu_q_lens, "cu_q_lens", "[S + 1]");
  CheckIndex(distribution, "distribution", "[3]");
  TORCH_CHECK(IsAttentionFloat(queries.scalar_type()), kOp, ": queries must be float32, bfloat16 or float16, got ",
              queries.scalar_type());
  TORCH_CHECK(IsAttentionFloat(kv_cache.scalar_type()), kOp, ": kv_cache must be float32, bfloat16 or float16, got ",
              kv_cache.scalar_type());
  // No conversion on the way into the cache (as kv_cache_update).
  TORCH_CHECK(keys.scalar_type() == kv_cache.scalar_type(), kOp, ": keys must have kv_cache's dtype ",
              kv_cache.scalar_type(), ", got ", keys.scalar_type());
  TORCH_CHECK(values.scalar_type() == kv_cache.scalar_type(), kOp, ": values must have kv_cache's dtype ",
              kv_cache.scalar_type(), ", got ", values.scalar_type());
  TORCH_CHECK(!out_dtype || IsAttentionFloat(*out_dtype), kOp, ": out_dtype must be float32, bfloat16 or float16, got ",
              *out_dtype);
  for (const Tensor* t : {&keys, &values, &kv_cache, &kv_lens, &page_indices, &cu_q_lens, &distribution}) {
    TORCH_CHECK(t->device() == queries.device(), kOp, ": every tensor must be on queries' device ", queries.device(),
                ", got ", t->device());
  }
  TORCH_SYM_CHECK(values.sym_size(0).sym_eq(keys.sym_size(0)).sym_and(values.sym_size(1).sym_eq(keys.sym_size(1)))
                      .sym_and(values.sym_size(2).sym_eq(keys.sym_size(2))),
                  kOp, ": values must have keys' shape ", ShapeString(keys), ", got shape ", ShapeString(values));
  TORCH_SYM_CHECK(keys.sym_size(0).sym_eq(queries.sym_size(0)).sym_and(keys.sym_size(2).sym_eq(queries.sym_size(2))),
                  kOp, ": keys must be [T, Hkv, D] with queries' T and D ", ShapeString(queries), ", got shape ",
                  ShapeString(keys));
  const c10::SymInt& hq = queries.sym_size(1);
  const c10::SymInt& hkv = keys.sym_size(1);
  TORCH_SYM_CHECK(hkv.sym_ge(1), kOp, ": keys must have at least one kv head, got shape ", ShapeString(keys));
  TORCH_SYM_CHECK((hq % hkv).sym_eq(0), kOp, ": the query heads Hq = ", hq,
                  " must be a multiple of the kv heads Hkv = ", hkv);
  TORCH_SYM_CHECK(kv_cache.sym_size(2).sym_eq(hkv * 2), kOp, ": kv_cache.shape[2] must be 2*Hkv = ", hkv * 2,
                  " (K and V of each kv head), got kv_cache shape ", ShapeString(kv_cache));
  TORCH_SYM_CHECK(kv_cache.sym_size(3).sym_eq(queries.sym_size(2)), kOp, ": kv_cache.shape[3] must be D = ",
                  queries.sym_size(2), " (no padding of D), got kv_cache shape ", ShapeString(kv_cache));
  TORCH_SYM_CHECK(kv_cache.sym_size(1).sym_ge(1), kOp, ": kv_cache.shape[1] (page_size) must be at least 1, got kv_cache shape ",
                  ShapeString(kv_cache));
  TORCH_SYM_CHECK(kv_cache.sym_stride(3).sym_eq(1).sym_or(kv_cache.sym_size(3).sym_le(1)), kOp,
                  ": kv_cache must have a contiguous last dimension (stride 1), got strides ", kv_cache.sym_strides());
  const c10::SymInt& seqs = kv_lens.sym_size(0);
  TORCH_SYM_CHECK(seqs.sym_ge(1), kOp, ": kv_lens must have at least one sequence, got shape ", ShapeString(kv_lens));
  TORCH_SYM_CHECK(cu_q_lens.sym_size(0).sym_eq(seqs + 1), kOp, ": cu_q_lens must be [S + 1] = [", seqs + 1,
                  "], got shape ", ShapeString(cu_q_lens));
  TORCH_SYM_CHECK(distribution.sym_size(0).sym_eq(3), kOp, ": distribution must be [3], got shape ",
                  ShapeString(distribution));
  TORCH_SYM_CHECK((page_indices.sym_size(0) % seqs).sym_eq(0), kOp,
                  ": page_indices must be [S * pages_per_seq] with S = ", seqs, ", got shape ",
                  ShapeString(page_indices));
  TORCH_CHECK(!sliding_window || *sliding_window >= 1, kOp, ": sliding_window must be at least 1, got ",
              sliding_window.value_or(0));
  TORCH_CHECK(!soft_cap || (*soft_cap > 0 && std::isfinite(*soft_cap)), kOp,
              ": soft_cap must be a positive finite number, got ", soft_cap.value_or(0));
  TORCH_CHECK(!sm_scale || std::isfinite(*sm_scale), kOp, ": sm_scale must be finite, got ", sm_scale.value_or(0));
  // A masked logit must stay below every real one's reach: -inf (the default) or a finite value.
  TORCH_CHECK(!mask_value || !(std::isnan(*mask_value) || *mask_value == std::numeric_limits<double>::infinity()), kOp,
              ": mask_value must be finite or -inf, got ", mask_value.value_or(0));
  return parsed;
}

KvCacheSlots IndexOf(const Tensor& t) {
  KvCacheSlots v;
  v.data = t.const_data_ptr();
  v.is_int64 = t.scalar_type() == at::kLong;
  v.count = t.size(0);
  v.stride = t.stride(0);
  return v;
}

// The params of a real call (views, no copy); out and lse may be undefined (the reference's check).
RaggedPagedAttentionParams ParamsOf(const Tensor& queries, const Tensor& keys, const Tensor& values,
                                    const Tensor& kv_cache, const Tensor& kv_lens, const Tensor& page_indices,
                                    const Tensor& cu_q_lens, const Tensor& distribution) {
  RaggedPagedAttentionParams p;
  p.queries = StridedViewOf<3>(queries, kOp);
  p.keys = StridedViewOf<3>(keys, kOp);
  p.values = StridedViewOf<3>(values, kOp);
  p.kv_cache = MutableStridedViewOf<4>(kv_cache, kOp);
  p.kv_lens = IndexOf(kv_lens);
  p.page_indices = IndexOf(page_indices);
  p.cu_q_lens = IndexOf(cu_q_lens);
  p.distribution = IndexOf(distribution);
  return p;
}

// The checks of real tensors both CPU implementations make before writing: no aliasing of the
// donated cache, every index value.
void CheckBeforeWrite(const Tensor& queries, const Tensor& keys, const Tensor& values, const Tensor& kv_cache,
                      const Tensor& kv_lens, const Tensor& page_indices, const Tensor& cu_q_lens,
                      const Tensor& distribution) {
  CheckDonatedBuffer(kOp, "kv_cache", kv_cache,
                     {{"queries", &queries}, {"keys", &keys}, {"values", &values}, {"kv_lens", &kv_lens},
                      {"page_indices", &page_indices}, {"cu_q_lens", &cu_q_lens}, {"distribution", &distribution}});
  const Status status = CheckRaggedPagedAttentionIndices(
      ParamsOf(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution));
  TORCH_CHECK(status.ok(), status.message());
}

RaggedPagedAttentionShape ShapeOf(const Tensor& queries, const Tensor& keys, const Tensor& kv_cache,
                                  const Tensor& kv_lens, const Tensor& page_indices) {
  RaggedPagedAttentionShape shape;
  shape.tokens = queries.size(0);
  shape.q_heads = queries.size(1);
  shape.kv_heads = keys.size(1);
  shape.head_dim = queries.size(2);
  shape.total_pages = kv_cache.size(0);
  shape.page_size = kv_cache.size(1);
  shape.num_seqs = kv_lens.size(0);
  shape.pages_per_seq = shape.num_seqs > 0 ? page_indices.size(0) / shape.num_seqs : 0;
  return shape;
}

std::tuple<Tensor, Tensor> RaggedPagedAttentionCpu(
    const Tensor& queries, const Tensor& keys, const Tensor& values, const Tensor& kv_cache, const Tensor& kv_lens,
    const Tensor& page_indices, const Tensor& cu_q_lens, const Tensor& distribution, bool use_causal_mask,
    std::optional<double> sm_scale, std::optional<int64_t> sliding_window, std::optional<double> soft_cap,
    std::optional<double> mask_value, std::optional<at::ScalarType> out_dtype, bool skip_kv_update,
    at::OptionalIntArrayRef config) {
  const auto parsed = CheckRaggedPagedAttentionArgs(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                                                    distribution, sliding_window, soft_cap, out_dtype, config, sm_scale,
                                                    mask_value);
  CheckBeforeWrite(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution);
  Tensor out = NewOutput(queries.sizes(), queries.options().dtype(out_dtype.value_or(queries.scalar_type())));
  Tensor lse = NewOutput({queries.size(0), queries.size(1)}, queries.options().dtype(at::kFloat));
  RaggedPagedAttentionParams p =
      ParamsOf(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution);
  p.causal = use_causal_mask;
  p.sm_scale = static_cast<float>(sm_scale.value_or(1.0));
  p.sliding_window = sliding_window.value_or(0);
  p.soft_cap = static_cast<float>(soft_cap.value_or(0.0));
  p.has_mask_value = mask_value.has_value();
  p.mask_value = static_cast<float>(mask_value.value_or(0.0));
  p.skip_kv_update = skip_kv_update;
  p.out = MutableStridedViewOf<3>(out, kOp);
  p.lse = MutableStridedViewOf<2>(lse, kOp);
  const RaggedPagedAttentionConfig resolved = ConfigOrHeuristic<&RaggedPagedAttentionHeuristicConfig>(
      parsed, ShapeOf(queries, keys, kv_cache, kv_lens, page_indices), p.kv_cache.dtype,
      RaggedPagedAttentionProduct::kForward);
  const Status status = RaggedPagedAttention(p, resolved);
  TORCH_CHECK(status.ok(), status.message());
  return {out, lse};
}

std::tuple<Tensor, Tensor> RaggedPagedAttentionMeta(
    const Tensor& queries, const Tensor& keys, const Tensor& values, const Tensor& kv_cache, const Tensor& kv_lens,
    const Tensor& page_indices, const Tensor& cu_q_lens, const Tensor& distribution, bool,
    std::optional<double> sm_scale, std::optional<int64_t> sliding_window, std::optional<double> soft_cap,
    std::optional<double> mask_value, std::optional<at::ScalarType> out_dtype, bool, at::OptionalIntArrayRef config) {
  CheckRaggedPagedAttentionArgs(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                sliding_window, soft_cap, out_dtype, config, sm_scale, mask_value);
  CheckDonatedBuffer(kOp, "kv_cache", kv_cache, {});
  return {at::empty_symint(queries.sym_sizes(), queries.options().dtype(out_dtype.value_or(queries.scalar_type()))),
          at::empty_symint({queries.sym_size(0), queries.sym_size(1)}, queries.options().dtype(at::kFloat))};
}

// Plain ATen ops: the slots written through kv_cache_update's reference, then per sequence its
// pages gathered (index_select), its K and V repeated over the group, softmax in fp32.
std::tuple<Tensor, Tensor> RaggedPagedAttentionReference(
    const Tensor& queries, const Tensor& keys, const Tensor& values, const Tensor& kv_cache, const Tensor& kv_lens,
    const Tensor& page_indices, const Tensor& cu_q_lens, const Tensor& distribution, bool use_causal_mask,
    std::optional<double> sm_scale, std::optional<int64_t> sliding_window, std::optional<double> soft_cap,
    std::optional<double> mask_value, std::optional<at::ScalarType> out_dtype, bool skip_kv_update,
    at::OptionalIntArrayRef config) {
  CheckRaggedPagedAttentionArgs(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                sliding_window, soft_cap, out_dtype, config, sm_scale,
                                mask_value);  // config validated, not used
  CheckBeforeWrite(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution);
  const RaggedPagedAttentionParams p =
      ParamsOf(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution);
  const int64_t tokens = queries.size(0), q_heads = queries.size(1), kv_heads = keys.size(1);
  const int64_t page_size = kv_cache.size(1), seqs = kv_lens.size(0), pages_per_seq = page_indices.size(0) / seqs;
  if (!skip_kv_update) {
    Tensor slots = at::empty({tokens}, kv_lens.options().dtype(at::kLong));
    RaggedPagedAttentionSlots(p, slots.data_ptr<int64_t>());
    static const auto update = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("tokamax::kv_cache_update_reference", "")
                                   .typed<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>();
    update.call(kv_cache, keys, values, slots);
  }
  const at::ScalarType result_dtype = out_dtype.value_or(queries.scalar_type());
  Tensor out = at::zeros(queries.sizes(), queries.options().dtype(at::kFloat));
  Tensor lse = at::full({tokens, q_heads}, -std::numeric_limits<float>::infinity(),
                        queries.options().dtype(at::kFloat));
  const int64_t active = p.distribution[2], group = q_heads / kv_heads;
  for (int64_t s = 0; s < active; ++s) {
    const int64_t q0 = p.cu_q_lens[s], q_len = p.cu_q_lens[s + 1] - q0, kv_len = p.kv_lens[s];
    if (q_len == 0) continue;
    const int64_t num_pages = (kv_len + page_size - 1) / page_size;
    const Tensor pages = page_indices.slice(0, s * pages_per_seq, s * pages_per_seq + num_pages).to(at::kLong);
    const Tensor kv = kv_cache.index_select(0, pages).reshape({num_pages * page_size, 2 * kv_heads, -1})
                          .slice(0, 0, kv_len).to(at::kFloat);
    const Tensor k = kv.slice(1, 0, 2 * kv_heads, 2).repeat_interleave(group, 1);  // [kv_len, Hq, D]
    const Tensor v = kv.slice(1, 1, 2 * kv_heads, 2).repeat_interleave(group, 1);
    const Tensor q = queries.slice(0, q0, q0 + q_len).to(at::kFloat);
    Tensor scores = at::einsum("qhd,khd->hqk", {q, k}) * sm_scale.value_or(1.0);
    if (soft_cap) scores = at::tanh(scores / *soft_cap) * *soft_cap;
    const Tensor pos = at::arange(kv_len - q_len, kv_len, kv_lens.options().dtype(at::kLong)).unsqueeze(1);
    const Tensor key = at::arange(kv_len, kv_lens.options().dtype(at::kLong)).unsqueeze(0);
    Tensor visible = at::ones({q_len, kv_len}, kv_lens.options().dtype(at::kBool));
    if (use_causal_mask) visible = visible & key.le(pos);
    if (sliding_window) visible = visible & key.gt(pos - *sliding_window);
    scores = scores.masked_fill(visible.logical_not(),
                                mask_value ? *mask_value : -std::numeric_limits<double>::infinity());
    out.slice(0, q0, q0 + q_len).copy_(at::einsum("hqk,khd->qhd", {at::softmax(scores, -1), v}));
    lse.slice(0, q0, q0 + q_len).copy_(at::logsumexp(scores, -1).transpose(0, 1));
  }
  return {out.to(result_dtype), lse};
}

// The problem of the config helper ops (op_kit.h): the call's sizes and the cache's dtype.
ConfigProblem<RaggedPagedAttentionShape> RaggedPagedAttentionConfigProblem(
    const Tensor& queries, const Tensor& keys, const Tensor& values, const Tensor& kv_cache, const Tensor& kv_lens,
    const Tensor& page_indices, const Tensor& cu_q_lens, const Tensor& distribution) {
  CheckRaggedPagedAttentionArgs(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution);
  return {ShapeOf(queries, keys, kv_cache, kv_lens, page_indices), ToCoreDType(kv_cache.scalar_type(), kOp)};
}

}  // namespace
}  // namespace tokamax

// kv_cache is donated: written in place (a!), returned by the Python singleton, not by the op (a
// custom op may not return an alias of its input; functionalization reinplaces the mutation).
// lse is always computed (T x Hq floats); the singleton returns it when asked.
#define TOKAMAX_RAGGED_PAGED_ATTENTION_ARGS                                                                       \
  "(Tensor queries, Tensor keys, Tensor values, Tensor(a!) kv_cache, Tensor kv_lens, Tensor page_indices, "      \
  "Tensor cu_q_lens, Tensor distribution, bool use_causal_mask=True, float? sm_scale=None, "                     \
  "int? sliding_window=None, float? soft_cap=None, float? mask_value=None, ScalarType? out_dtype=None, "         \
  "bool skip_kv_update=False, int[]? config=None) -> (Tensor out, Tensor lse)"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("ragged_paged_attention" TOKAMAX_RAGGED_PAGED_ATTENTION_ARGS);
  m.def("ragged_paged_attention_reference" TOKAMAX_RAGGED_PAGED_ATTENTION_ARGS);
  tokamax::DefineConfigOps<&tokamax::RaggedPagedAttentionConfigProblem, &tokamax::RaggedPagedAttentionHeuristicConfig,
                           &tokamax::RaggedPagedAttentionConfigSpace>(
      m, "Tensor queries, Tensor keys, Tensor values, Tensor kv_cache, Tensor kv_lens, Tensor page_indices, "
         "Tensor cu_q_lens, Tensor distribution");
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("ragged_paged_attention", &tokamax::RaggedPagedAttentionCpu);
  m.impl("ragged_paged_attention_reference", &tokamax::RaggedPagedAttentionReference);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("ragged_paged_attention", &tokamax::RaggedPagedAttentionMeta);
  m.impl("ragged_paged_attention_reference", &tokamax::RaggedPagedAttentionMeta);
}

// No gradient (it writes state; upstream's is not differentiable either): outputs never require
// grad, for both singletons.
TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("ragged_paged_attention", torch::CppFunction::makeFromBoxedFunction<&tokamax::RunBelowAutograd>());
  m.impl("ragged_paged_attention_reference", torch::CppFunction::makeFromBoxedFunction<&tokamax::RunBelowAutograd>());
}

TORCH_LIBRARY_IMPL(tokamax, AutocastCPU, m) {
  tokamax::RegisterInputDtypeAutocast(m, {"ragged_paged_attention", "ragged_paged_attention_reference"});
}
