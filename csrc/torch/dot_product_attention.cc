// tokamax::dot_product_attention, its reference twin and its backward op: schemas, the shared
// argument check, the CPU kernel adapters, the ATen reference, SymInt meta kernels and C++
// autograd.
//
// The reference is CompositeImplicitAutograd: plain ATen ops whose own autograd and meta
// decompositions give an independent oracle for the kernel's hand-written backward.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "csrc/core/runtime/cpu_info.h"
#include "csrc/ops/dot_product_attention/dot_product_attention.h"
#include "csrc/torch/adapter_utils.h"
#include "csrc/torch/op_kit.h"

namespace tokamax {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

constexpr const char* kOp = "dot_product_attention";

// The schema's attention arguments (the backward op has all but `config`), packed once per call
// by the entry points below and passed whole to the check, the kernel inputs, the reference and
// the autograd Function. It owns its values, so the autograd backward can rebuild it from what
// the forward saved.
struct AttentionArgs {
  Tensor query, key, value;
  std::optional<Tensor> bias, mask;
  std::optional<double> scale;
  bool is_causal = false;
  std::optional<Tensor> query_seq_lengths, key_value_seq_lengths;
  std::optional<std::vector<int64_t>> local_window_size;
  std::optional<double> logits_soft_cap;
  std::optional<Tensor> q_segment_ids, kv_segment_ids;
  std::optional<std::vector<int64_t>> config, bwd_config;
};

std::optional<std::vector<int64_t>> Owned(at::OptionalIntArrayRef values) {
  if (!values.has_value()) return std::nullopt;
  return values->vec();
}

at::OptionalIntArrayRef Ref(const std::optional<std::vector<int64_t>>& values) {
  if (!values.has_value()) return std::nullopt;
  return at::IntArrayRef(*values);
}

// The entry points bound with m.impl: each takes its schema's arguments, packs them and hands
// them to `Impl`.
template <std::tuple<Tensor, Tensor> (*Impl)(const AttentionArgs&)>
std::tuple<Tensor, Tensor> ForwardEntry(
    const Tensor& query, const Tensor& key, const Tensor& value, const std::optional<Tensor>& bias,
    const std::optional<Tensor>& mask, std::optional<double> scale, bool is_causal,
    const std::optional<Tensor>& query_seq_lengths, const std::optional<Tensor>& key_value_seq_lengths,
    at::OptionalIntArrayRef local_window_size, std::optional<double> logits_soft_cap,
    const std::optional<Tensor>& q_segment_ids, const std::optional<Tensor>& kv_segment_ids,
    at::OptionalIntArrayRef config, at::OptionalIntArrayRef bwd_config) {
  return Impl(AttentionArgs{query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                            key_value_seq_lengths, Owned(local_window_size), logits_soft_cap, q_segment_ids,
                            kv_segment_ids, Owned(config), Owned(bwd_config)});
}

// The backward op's own arguments, besides the forward's.
struct GradArgs {
  Tensor dout;
  std::optional<Tensor> dlse;
  Tensor out, lse;
  bool bias_requires_grad = false;
};

using BackwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// The same for the backward op.
template <BackwardResult (*Impl)(const AttentionArgs&, const GradArgs&)>
BackwardResult BackwardEntry(
    const Tensor& dout, const std::optional<Tensor>& dlse, const Tensor& query, const Tensor& key,
    const Tensor& value, const std::optional<Tensor>& bias, const std::optional<Tensor>& mask, const Tensor& out,
    const Tensor& lse, std::optional<double> scale, bool is_causal, const std::optional<Tensor>& query_seq_lengths,
    const std::optional<Tensor>& key_value_seq_lengths, at::OptionalIntArrayRef local_window_size,
    std::optional<double> logits_soft_cap, const std::optional<Tensor>& q_segment_ids,
    const std::optional<Tensor>& kv_segment_ids, bool bias_requires_grad, at::OptionalIntArrayRef bwd_config) {
  return Impl(AttentionArgs{query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                            key_value_seq_lengths, Owned(local_window_size), logits_soft_cap, q_segment_ids,
                            kv_segment_ids, /*config=*/std::nullopt, Owned(bwd_config)},
              GradArgs{dout, dlse, out, lse, bias_requires_grad});
}

struct AttentionConfigs {
  std::optional<DotProductAttentionConfig> forward;
  std::optional<DotProductAttentionConfig> backward;
};

// What the check derives from valid arguments.
struct AttentionSignature {
  c10::SymInt batch, q_len, kv_len, q_heads, kv_heads, head_dim, value_dim;
  int64_t window_left = AttentionMasks::kUnbounded;
  int64_t window_right = AttentionMasks::kUnbounded;
  bool block_sparse = false;  // some mask lets whole kv tiles be skipped
  at::ScalarType lse_dtype = at::kFloat;
  AttentionConfigs configs;
};

// `name` must broadcast to [B, N, T, S] (right-aligned, each size 1 or equal).
void CheckBroadcastable(const Tensor& t, const char* name, const std::vector<c10::SymInt>& target) {
  TORCH_CHECK(t.dim() <= 4, kOp, ": ", name, " must be broadcastable to [B, N, T, S] = ", target,
              ", got shape ", ShapeString(t));
  for (int64_t i = 0; i < t.dim(); ++i) {
    const c10::SymInt& size = t.sym_size(i);
    if (size.maybe_as_int() == std::optional<int64_t>(1)) continue;
    const c10::SymInt& want = target[4 - t.dim() + i];
    TORCH_SYM_CHECK(size.sym_eq(want), kOp, ": ", name, " must be broadcastable to [B, N, T, S] = ", target,
                    ", got shape ", ShapeString(t), " (dimension ", i, " is ", size, ")");
  }
}

void CheckLengths(const std::optional<Tensor>& lengths, const char* name, const c10::SymInt& batch,
                  const at::Device& device) {
  if (!lengths.has_value()) return;
  TORCH_CHECK(lengths->scalar_type() == at::kInt || lengths->scalar_type() == at::kLong, kOp, ": ", name,
              " must be int32 or int64, got ", lengths->scalar_type());
  TORCH_CHECK(lengths->dim() == 1, kOp, ": ", name, " must be 1-D [B], got shape ", ShapeString(*lengths));
  TORCH_SYM_CHECK(lengths->sym_size(0).sym_eq(batch), kOp, ": ", name, " must have B = ", batch,
                  " entries, got shape ", ShapeString(*lengths));
  TORCH_CHECK(lengths->device() == device, kOp, ": ", name, " must be on ", device, " like query, got ",
              lengths->device());
}

void CheckSegmentIds(const Tensor& ids, const char* name, const c10::SymInt& batch, const c10::SymInt& len,
                     const char* len_name, const at::Device& device) {
  TORCH_CHECK(ids.scalar_type() == at::kInt, kOp, ": ", name, " must be int32, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() == 2, kOp, ": ", name, " must be 2-D [B, ", len_name, "], got shape ", ShapeString(ids));
  TORCH_SYM_CHECK(ids.sym_size(0).sym_eq(batch) & ids.sym_size(1).sym_eq(len), kOp, ": ", name, " must have shape [B, ",
                  len_name, "] = [", batch, ", ", len, "], got ", ShapeString(ids));
  TORCH_CHECK(ids.device() == device, kOp, ": ", name, " must be on ", device, " like query, got ", ids.device());
}

// The one argument check, shared by the kernel, the reference, the backward op and the meta
// kernels, so eager and compiled code raise the same errors. Only metadata is read; length
// values are checked by the CPU kernels before any compute.
AttentionSignature CheckAttentionArgs(const AttentionArgs& a) {
  const Tensor &query = a.query, &key = a.key, &value = a.value;
  AttentionSignature sig;
  sig.configs.forward = ParseOptionalConfig<DotProductAttentionConfig>(Ref(a.config), "config");
  sig.configs.backward = ParseOptionalConfig<DotProductAttentionConfig>(Ref(a.bwd_config), "bwd_config");

  TORCH_CHECK(query.dim() == 4, kOp, ": query must be 4-D [B, T, N, H], got shape ", ShapeString(query));
  TORCH_CHECK(key.dim() == 4, kOp, ": key must be 4-D [B, S, K, H], got shape ", ShapeString(key));
  TORCH_CHECK(value.dim() == 4, kOp, ": value must be 4-D [B, S, K, Hv], got shape ", ShapeString(value));
  TORCH_CHECK(IsSupportedFloat(query.scalar_type()), kOp,
              ": query must be float32, bfloat16, float16 or float64, got ", query.scalar_type());
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(), kOp,
              ": query, key and value must have one dtype, got ", query.scalar_type(), ", ", key.scalar_type(),
              " and ", value.scalar_type());
  const at::Device device = query.device();
  TORCH_CHECK(key.device() == device && value.device() == device, kOp,
              ": query, key and value must be on one device, got ", device, ", ", key.device(), " and ",
              value.device());
  sig.batch = query.sym_size(0);
  sig.q_len = query.sym_size(1);
  sig.q_heads = query.sym_size(2);
  sig.head_dim = query.sym_size(3);
  sig.kv_len = key.sym_size(1);
  sig.kv_heads = key.sym_size(2);
  sig.value_dim = value.sym_size(3);
  TORCH_SYM_CHECK(key.sym_size(0).sym_eq(sig.batch) & value.sym_size(0).sym_eq(sig.batch), kOp,
                  ": key and value must have batch size B = ", sig.batch, " like query, got key ",
                  ShapeString(key), " and value ", ShapeString(value));
  TORCH_SYM_CHECK(key.sym_size(3).sym_eq(sig.head_dim), kOp, ": key's head dim must equal query's (", sig.head_dim,
                  "), got key ", ShapeString(key), " and query ", ShapeString(query));
  TORCH_SYM_CHECK(value.sym_size(1).sym_eq(sig.kv_len) & value.sym_size(2).sym_eq(sig.kv_heads), kOp,
                  ": value must be [B, S, K, Hv] with S and K of key, got value ", ShapeString(value), " and key ",
                  ShapeString(key));
  TORCH_SYM_CHECK(sig.kv_heads.sym_ge(1), kOp, ": key must have at least one head, got shape ", ShapeString(key));
  TORCH_SYM_CHECK((sig.q_heads % sig.kv_heads).sym_eq(0), kOp,
                  ": the number of query heads must be a multiple of the number of kv heads, got N = ",
                  sig.q_heads, " and K = ", sig.kv_heads);
  const std::vector<c10::SymInt> logits_shape = {sig.batch, sig.q_heads, sig.q_len, sig.kv_len};
  if (a.bias.has_value()) {
    TORCH_CHECK(IsSupportedFloat(a.bias->scalar_type()), kOp,
                ": bias must be float32, bfloat16, float16 or float64, got ", a.bias->scalar_type());
    TORCH_CHECK(a.bias->device() == device, kOp, ": bias must be on ", device, " like query, got ", a.bias->device());
    CheckBroadcastable(*a.bias, "bias", logits_shape);
  }
  if (a.mask.has_value()) {
    TORCH_CHECK(a.mask->scalar_type() == at::kBool, kOp, ": mask must be bool (True = visible), got ",
                a.mask->scalar_type());
    TORCH_CHECK(a.mask->device() == device, kOp, ": mask must be on ", device, " like query, got ", a.mask->device());
    CheckBroadcastable(*a.mask, "mask", logits_shape);
  }
  if (a.scale.has_value()) {
    TORCH_CHECK(std::isfinite(*a.scale), kOp, ": scale must be finite, got ", *a.scale);
  }
  if (a.logits_soft_cap.has_value()) {
    TORCH_CHECK(std::isfinite(*a.logits_soft_cap) && *a.logits_soft_cap > 0.0, kOp,
                ": logits_soft_cap must be a positive finite number, got ", *a.logits_soft_cap);
  }
  if (a.local_window_size.has_value()) {
    TORCH_CHECK(a.local_window_size->size() == 2, kOp,
                ": local_window_size must be (left, right), two non-negative ints, got ", a.local_window_size->size(),
                " values");
    const int64_t left = (*a.local_window_size)[0], right = (*a.local_window_size)[1];
    TORCH_CHECK(left >= 0 && right >= 0, kOp, ": local_window_size must be non-negative, got (", left, ", ",
                right, ")");
    sig.window_left = std::min(left, AttentionMasks::kUnbounded);
    sig.window_right = std::min(right, AttentionMasks::kUnbounded);
  }
  CheckLengths(a.query_seq_lengths, "query_seq_lengths", sig.batch, device);
  CheckLengths(a.key_value_seq_lengths, "key_value_seq_lengths", sig.batch, device);
  TORCH_CHECK(a.q_segment_ids.has_value() == a.kv_segment_ids.has_value(), kOp,
              ": q_segment_ids and kv_segment_ids must be given together, got only ",
              a.q_segment_ids.has_value() ? "q_segment_ids" : "kv_segment_ids");
  if (a.q_segment_ids.has_value()) {
    CheckSegmentIds(*a.q_segment_ids, "q_segment_ids", sig.batch, sig.q_len, "T", device);
    CheckSegmentIds(*a.kv_segment_ids, "kv_segment_ids", sig.batch, sig.kv_len, "S", device);
  }
  // A bool mask is counted too: passed as a tensor, a causal, window or padding mask skips tiles
  // as the same mask given by its arguments does (FoldMaskRuns), and gets the same config.
  sig.block_sparse = a.is_causal || a.local_window_size.has_value() || a.query_seq_lengths.has_value() ||
                     a.key_value_seq_lengths.has_value() || a.q_segment_ids.has_value() || a.mask.has_value();
  sig.lse_dtype = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return sig;
}

double ScaleOf(std::optional<double> scale, const AttentionSignature& sig) {
  if (scale.has_value()) return *scale;
  return 1.0 / std::sqrt(static_cast<double>(sig.head_dim.guard_int(__FILE__, __LINE__)));
}

std::vector<c10::SymInt> OutShape(const AttentionSignature& sig) {
  return {sig.batch, sig.q_len, sig.q_heads, sig.value_dim};
}

std::vector<c10::SymInt> LseShape(const AttentionSignature& sig) { return {sig.batch, sig.q_heads, sig.q_len}; }

DotProductAttentionShape ShapeOf(const AttentionSignature& sig) {
  DotProductAttentionShape shape;
  shape.batch = sig.batch.expect_int();
  shape.q_len = sig.q_len.expect_int();
  shape.kv_len = sig.kv_len.expect_int();
  shape.q_heads = sig.q_heads.expect_int();
  shape.kv_heads = sig.kv_heads.expect_int();
  shape.head_dim = sig.head_dim.expect_int();
  shape.value_dim = sig.value_dim.expect_int();
  shape.block_sparse = sig.block_sparse;
  return shape;
}

DotProductAttentionConfig ResolveConfig(const std::optional<DotProductAttentionConfig>& config,
                                        const AttentionSignature& sig, at::ScalarType dtype,
                                        DotProductAttentionProduct product) {
  return ConfigOrHeuristic<&DotProductAttentionHeuristicConfig>(config, ShapeOf(sig), ToCoreDType(dtype, kOp),
                                                                product);
}

std::vector<int64_t> LengthValues(const std::optional<Tensor>& lengths, int64_t max, const char* name) {
  if (!lengths.has_value()) return {};
  const Tensor values = lengths->to(at::kLong).contiguous();
  std::vector<int64_t> result(values.const_data_ptr<int64_t>(), values.const_data_ptr<int64_t>() + values.numel());
  const Status status = CheckAttentionLengths(result.data(), static_cast<int64_t>(result.size()), max, name);
  TORCH_CHECK(status.ok(), status.message());
  return result;
}

// The kernel's view of one call's inputs; owns what its pointers point into. Not copyable.
struct KernelInputs {
  KernelInputs() = default;
  KernelInputs(const KernelInputs&) = delete;
  KernelInputs& operator=(const KernelInputs&) = delete;

  DotProductAttentionParams params;
  std::vector<int64_t> q_lengths, kv_lengths;
  Tensor bias, mask;  // expanded to [B, N, T, S] (stride-0 views, no copies)
};

void FillKernelInputs(const AttentionArgs& a, const AttentionSignature& sig, KernelInputs* in) {
  DotProductAttentionParams& p = in->params;
  p.q = StridedViewOf<4>(a.query, kOp);
  p.k = StridedViewOf<4>(a.key, kOp);
  p.v = StridedViewOf<4>(a.value, kOp);
  const std::vector<int64_t> logits_shape = {sig.batch.expect_int(), sig.q_heads.expect_int(),
                                             sig.q_len.expect_int(), sig.kv_len.expect_int()};
  if (a.bias.has_value()) {
    in->bias = a.bias->expand(logits_shape);
    p.bias = StridedViewOf<4>(in->bias, kOp);
  }
  AttentionMasks& m = p.masks;
  if (a.mask.has_value()) {
    in->mask = a.mask->expand(logits_shape);
    m.mask = reinterpret_cast<const uint8_t*>(in->mask.const_data_ptr<bool>());
    for (int64_t d = 0; d < 4; ++d) m.mask_strides[d] = in->mask.stride(d);
  }
  m.is_causal = a.is_causal;
  m.window_left = sig.window_left;
  m.window_right = sig.window_right;
  in->q_lengths = LengthValues(a.query_seq_lengths, logits_shape[2], "query_seq_lengths");
  in->kv_lengths = LengthValues(a.key_value_seq_lengths, logits_shape[3], "key_value_seq_lengths");
  if (a.query_seq_lengths.has_value()) m.q_lengths = in->q_lengths.data();
  if (a.key_value_seq_lengths.has_value()) m.kv_lengths = in->kv_lengths.data();
  if (a.q_segment_ids.has_value()) {
    m.q_segment_ids = a.q_segment_ids->const_data_ptr<int32_t>();
    m.q_segment_strides[0] = a.q_segment_ids->stride(0);
    m.q_segment_strides[1] = a.q_segment_ids->stride(1);
    m.kv_segment_ids = a.kv_segment_ids->const_data_ptr<int32_t>();
    m.kv_segment_strides[0] = a.kv_segment_ids->stride(0);
    m.kv_segment_strides[1] = a.kv_segment_ids->stride(1);
  }
  p.scale = static_cast<float>(ScaleOf(a.scale, sig));
  p.logits_soft_cap = a.logits_soft_cap.has_value() ? static_cast<float>(*a.logits_soft_cap) : 0.0f;
}

void SetLse(Tensor& lse, DotProductAttentionParams* p) {
  p->lse = lse.data_ptr();
  for (int64_t d = 0; d < 3; ++d) p->lse_strides[d] = lse.stride(d);
}

void CheckCpu(const Tensor& query) {
  TORCH_CHECK(query.device().is_cpu(), kOp, ": the kernel runs on CPU tensors, got ", query.device());
}

// ---- the CPU kernels ---------------------------------------------------------------------------

std::tuple<Tensor, Tensor> DotProductAttentionCpu(const AttentionArgs& a) {
  const AttentionSignature sig = CheckAttentionArgs(a);
  CheckCpu(a.query);
  const DotProductAttentionConfig resolved = ResolveConfig(sig.configs.forward, sig, a.query.scalar_type(),
                                                           DotProductAttentionProduct::kForward);
  KernelInputs in;
  FillKernelInputs(a, sig, &in);
  Tensor out = NewOutputSymint(OutShape(sig), a.query.options());
  Tensor lse = NewOutputSymint(LseShape(sig), a.query.options().dtype(sig.lse_dtype));
  in.params.out = MutableStridedViewOf<4>(out, kOp);
  SetLse(lse, &in.params);
  const Status status = DotProductAttention(in.params, resolved);
  TORCH_CHECK(status.ok(), status.message());
  return {out, lse};
}

std::tuple<Tensor, Tensor> DotProductAttentionMeta(const AttentionArgs& a) {
  const AttentionSignature sig = CheckAttentionArgs(a);
  return {at::empty_symint(OutShape(sig), a.query.options()),
          at::empty_symint(LseShape(sig), a.query.options().dtype(sig.lse_dtype))};
}

// Checks the backward's own tensors against the forward's signature.
void CheckBackwardArgs(const GradArgs& g, const Tensor& query, const AttentionSignature& sig) {
  const Tensor &dout = g.dout, &out = g.out, &lse = g.lse;
  const std::optional<Tensor>& dlse = g.dlse;
  const std::vector<c10::SymInt> out_shape = OutShape(sig), lse_shape = LseShape(sig);
  auto same_shape = [](const Tensor& t, const std::vector<c10::SymInt>& shape) {
    if (t.dim() != static_cast<int64_t>(shape.size())) return c10::SymBool(false);
    c10::SymBool all(true);
    for (size_t i = 0; i < shape.size(); ++i) all = all & t.sym_size(i).sym_eq(shape[i]);
    return all;
  };
  TORCH_SYM_CHECK(same_shape(out, out_shape), kOp, " backward: out must have shape ", out_shape, ", got ",
                  ShapeString(out));
  TORCH_SYM_CHECK(same_shape(dout, out_shape), kOp, " backward: dout must have shape ", out_shape, ", got ",
                  ShapeString(dout));
  TORCH_SYM_CHECK(same_shape(lse, lse_shape), kOp, " backward: logsumexp must have shape ", lse_shape, ", got ",
                  ShapeString(lse));
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && dout.scalar_type() == query.scalar_type(), kOp,
              " backward: out and dout must have query's dtype ", query.scalar_type(), ", got ", out.scalar_type(),
              " and ", dout.scalar_type());
  TORCH_CHECK(lse.scalar_type() == sig.lse_dtype, kOp, " backward: logsumexp must be ", sig.lse_dtype, ", got ",
              lse.scalar_type());
  if (dlse.has_value()) {
    TORCH_SYM_CHECK(same_shape(*dlse, lse_shape), kOp, " backward: dlse must have shape ", lse_shape, ", got ",
                    ShapeString(*dlse));
    TORCH_CHECK(dlse->scalar_type() == sig.lse_dtype, kOp, " backward: dlse must be ", sig.lse_dtype, ", got ",
                dlse->scalar_type());
  }
}

BackwardResult EmptyGradients(const AttentionArgs& a, bool bias_requires_grad, const AttentionSignature& sig) {
  Tensor dq = NewOutputSymint({sig.batch, sig.q_len, sig.q_heads, sig.head_dim}, a.query.options());
  Tensor dk = NewOutputSymint({sig.batch, sig.kv_len, sig.kv_heads, sig.head_dim}, a.key.options());
  Tensor dv = NewOutputSymint({sig.batch, sig.kv_len, sig.kv_heads, sig.value_dim}, a.value.options());
  Tensor dbias = bias_requires_grad && a.bias.has_value() ? NewOutputSymint(a.bias->sym_sizes(), a.bias->options())
                                                          : at::empty({0}, a.query.options());
  return {dq, dk, dv, dbias};
}

BackwardResult DotProductAttentionBackwardCpu(const AttentionArgs& a, const GradArgs& grad) {
  const AttentionSignature sig = CheckAttentionArgs(a);
  CheckBackwardArgs(grad, a.query, sig);
  CheckCpu(a.query);
  const DotProductAttentionConfig resolved = ResolveConfig(sig.configs.backward, sig, a.query.scalar_type(),
                                                           DotProductAttentionProduct::kBackward);
  KernelInputs in;
  FillKernelInputs(a, sig, &in);
  auto [dq, dk, dv, dbias] = EmptyGradients(a, grad.bias_requires_grad, sig);
  DotProductAttentionGradParams g;
  g.forward = in.params;
  g.forward.out = MutableStridedViewOf<4>(grad.out, kOp);  // read only here: the params' output type
  Tensor lse_view = grad.lse;
  SetLse(lse_view, &g.forward);
  g.dout = StridedViewOf<4>(grad.dout, kOp);
  if (grad.dlse.has_value()) {
    g.dlse = grad.dlse->const_data_ptr();
    for (int64_t d = 0; d < 3; ++d) g.dlse_strides[d] = grad.dlse->stride(d);
  }
  g.dq = MutableStridedViewOf<4>(dq, kOp);
  g.dk = MutableStridedViewOf<4>(dk, kOp);
  g.dv = MutableStridedViewOf<4>(dv, kOp);
  Tensor dense_dbias;
  // A bias shared by the batches has its gradient summed over them in batch order, one fp32
  // addition per batch from zero, whichever of two ways computes it: the kernel adds each batch
  // into a [1, N, T, S] buffer as it goes (no B-times buffer; the batches then run one after the
  // other), or, when one batch has fewer tasks than there are threads, the kernel writes
  // [B, N, T, S] and the batches are added here in the same order. Same bits either way.
  const int64_t batch = sig.batch.expect_int();
  const bool shared_by_batches = a.bias.has_value() && (a.bias->dim() < 4 || a.bias->size(0) == 1) && batch > 1;
  if (grad.bias_requires_grad && a.bias.has_value()) {
    g.dbias_sum_batches = shared_by_batches && DotProductAttentionBackwardTasksPerBatch(
                                                   sig.q_len.expect_int(), sig.kv_heads.expect_int(), resolved) >=
                                                   at::get_num_threads();
    const std::vector<int64_t> dense_sizes = {g.dbias_sum_batches ? 1 : batch, sig.q_heads.expect_int(),
                                              sig.q_len.expect_int(), sig.kv_len.expect_int()};
    // A bias with every head, query and key (its batch dimension as the kernel writes it) whose
    // gradient is contiguous in the dtype the kernel accumulates in: written in place, without
    // a dense buffer and its copy (256 MiB each for 16 heads at T = S = 2048).
    const bool whole = !shared_by_batches || g.dbias_sum_batches;
    if (whole && dbias.scalar_type() == sig.lse_dtype && dbias.is_contiguous() &&
        dbias.numel() == c10::multiply_integers(dense_sizes) && dbias.dim() >= 3 &&
        dbias.size(-1) == dense_sizes[3] && dbias.size(-2) == dense_sizes[2] && dbias.size(-3) == dense_sizes[1]) {
      g.dbias = dbias.data_ptr();
    } else {
      dense_dbias = NewOutput(dense_sizes, a.query.options().dtype(sig.lse_dtype));
      g.dbias = dense_dbias.data_ptr();
    }
  }
  const Status status = DotProductAttentionBackward(g, resolved);
  TORCH_CHECK(status.ok(), status.message());
  if (dense_dbias.defined()) {
    if (shared_by_batches && !g.dbias_sum_batches) {
      Tensor summed = NewZeroedOutput(dense_dbias[0].sizes(), dense_dbias.options());
      for (int64_t b = 0; b < batch; ++b) summed.add_(dense_dbias[b]);
      dense_dbias = summed.unsqueeze(0);
    }
    // Only dimensions of size 1 apart (a bias of every head, query and key in another dtype):
    // one converting copy, not a sum that allocates a dense result first.
    dbias.copy_(dense_dbias.numel() == dbias.numel() ? dense_dbias.view(dbias.sizes())
                                                     : dense_dbias.sum_to_size(a.bias->sizes()));
  }
  return {dq, dk, dv, dbias};
}

BackwardResult DotProductAttentionBackwardMeta(const AttentionArgs& a, const GradArgs& grad) {
  const AttentionSignature sig = CheckAttentionArgs(a);
  CheckBackwardArgs(grad, a.query, sig);
  return EmptyGradients(a, grad.bias_requires_grad, sig);
}

// ---- the reference: plain ATen ops, fp32 (float64 for float64) softmax -------------------------

// Which (b, n, t, s) are visible, as a bool tensor broadcastable to [B, N, T, S]; undefined
// when every pair is.
Tensor VisibilityMask(const AttentionArgs& a, const AttentionSignature& sig) {
  const auto index_options = a.query.options().dtype(at::kLong);
  const Tensor t = at::arange(c10::Scalar(sig.q_len), index_options).view({-1, 1});   // [T, 1]
  const Tensor s = at::arange(c10::Scalar(sig.kv_len), index_options).view({1, -1});  // [1, S]
  Tensor visible;
  auto both = [&visible](const Tensor& condition) { visible = visible.defined() ? visible & condition : condition; };
  if (a.is_causal) both(s <= t);
  if (sig.window_left < AttentionMasks::kUnbounded) both(s >= t - sig.window_left);
  if (sig.window_right < AttentionMasks::kUnbounded) both(s <= t + sig.window_right);
  if (a.query_seq_lengths.has_value()) both(t.view({1, 1, -1, 1}) < a.query_seq_lengths->view({-1, 1, 1, 1}));
  if (a.key_value_seq_lengths.has_value()) both(s.view({1, 1, 1, -1}) < a.key_value_seq_lengths->view({-1, 1, 1, 1}));
  if (a.q_segment_ids.has_value()) {
    both(a.q_segment_ids->unsqueeze(1).unsqueeze(3) == a.kv_segment_ids->unsqueeze(1).unsqueeze(2));
  }
  if (a.mask.has_value()) both(*a.mask);
  return visible;
}

std::tuple<Tensor, Tensor> DotProductAttentionReferenceImpl(const AttentionArgs& a) {
  const AttentionSignature sig = CheckAttentionArgs(a);
  const at::ScalarType acc = sig.lse_dtype;
  const c10::SymInt group = sig.q_heads / sig.kv_heads;
  // [B, T, N, H] -> [B, K, G, T, H]; key and value [B, S, K, *] -> [B, K, 1, S, *] (no repeat).
  const Tensor q = a.query.to(acc).view_symint({sig.batch, sig.q_len, sig.kv_heads, group, sig.head_dim})
                       .permute({0, 2, 3, 1, 4});
  const Tensor k = a.key.to(acc).permute({0, 2, 1, 3}).unsqueeze(2);
  const Tensor v = a.value.to(acc).permute({0, 2, 1, 3}).unsqueeze(2);
  const Tensor visible = VisibilityMask(a, sig);
  Tensor logits = at::matmul(q, k.transpose(-1, -2)) * ScaleOf(a.scale, sig);  // [B, K, G, T, S]
  logits = logits.reshape_symint({sig.batch, sig.q_heads, sig.q_len, sig.kv_len});
  if (a.bias.has_value()) logits = logits + a.bias->to(acc);
  if (a.logits_soft_cap.has_value()) logits = at::tanh(logits / *a.logits_soft_cap) * *a.logits_soft_cap;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (visible.defined()) logits = at::where(visible, logits, neg_inf);
  // Safe softmax: rows with no visible key have max -inf; shift them by 0 so exp gives 0, and
  // keep every where() branch finite so gradients stay 0, never NaN.
  // (max() rejects an empty dimension: without keys every row is empty, and the shift is 0.)
  const bool no_keys = sig.kv_len.maybe_as_int() == std::optional<int64_t>(0);
  const Tensor max = no_keys ? at::full_symint({sig.batch, sig.q_heads, sig.q_len, 1}, neg_inf, logits.options())
                             : std::get<0>(logits.detach().max(-1, /*keepdim=*/true));
  const Tensor shift = at::where(at::isfinite(max), max, 0.0);
  const Tensor probs = at::exp(logits - shift);
  const Tensor sum = probs.sum(-1, /*keepdim=*/true);
  // sum is 0 only for a row that sees no key; NaN (a NaN or overflowed logit) stays NaN.
  const Tensor nonempty = sum != 0;
  const Tensor safe_sum = at::where(nonempty, sum, 1.0);
  const Tensor weighted = at::matmul(probs.view_symint({sig.batch, sig.kv_heads, group, sig.q_len, sig.kv_len}), v);
  const Tensor out = (weighted.reshape_symint({sig.batch, sig.q_heads, sig.q_len, sig.value_dim}) / safe_sum)
                         .permute({0, 2, 1, 3})
                         .to(a.query.scalar_type())
                         .contiguous();
  const Tensor lse = at::where(nonempty, shift + at::log(safe_sum), neg_inf).squeeze(-1);
  return {out, lse};
}

// ---- autograd ----------------------------------------------------------------------------------

// The registered ops' C++ signatures: those of their m.impl entry points.
using ForwardSignature = decltype(ForwardEntry<DotProductAttentionMeta>);
using BackwardSignature = decltype(BackwardEntry<DotProductAttentionBackwardMeta>);

const c10::TypedOperatorHandle<ForwardSignature>& ForwardOp() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("tokamax::dot_product_attention", "").typed<ForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSignature>& BackwardOp() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tokamax::_dot_product_attention_backward", "")
                             .typed<BackwardSignature>();
  return op;
}

std::optional<Tensor> Optional(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

std::optional<double> OptionalDouble(const c10::IValue& value) {
  return value.isNone() ? std::nullopt : std::optional<double>(value.toDouble());
}

std::optional<std::vector<int64_t>> OptionalInts(const c10::IValue& value) {
  return value.isNone() ? std::nullopt : std::optional<std::vector<int64_t>>(value.toIntVector());
}

template <typename T>
c10::IValue ToIValue(const std::optional<T>& value) {
  return value.has_value() ? c10::IValue(*value) : c10::IValue();
}

// Residuals: the inputs, out and logsumexp. The backward recomputes probabilities from them
// tile by tile (FlashAttention-2), so nothing of size T x S is saved.
//
// apply() counts only tensor arguments as inputs, so the four that can have gradients are passed
// on their own as well as in the AttentionArgs (the other tensors are bool or integer).
class DotProductAttentionFunction : public torch::autograd::Function<DotProductAttentionFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const Tensor& /*query*/, const Tensor& /*key*/,
                             const Tensor& /*value*/, const std::optional<Tensor>& /*bias*/, const AttentionArgs& a) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = ForwardOp().call(a.query, a.key, a.value, a.bias, a.mask, a.scale, a.is_causal,
                                       a.query_seq_lengths, a.key_value_seq_lengths, Ref(a.local_window_size),
                                       a.logits_soft_cap, a.q_segment_ids, a.kv_segment_ids, Ref(a.config),
                                       Ref(a.bwd_config));
    ctx->saved_data["scale"] = ToIValue(a.scale);
    ctx->saved_data["is_causal"] = a.is_causal;
    ctx->saved_data["window"] = ToIValue(a.local_window_size);
    ctx->saved_data["logits_soft_cap"] = ToIValue(a.logits_soft_cap);
    ctx->saved_data["bwd_config"] = ToIValue(a.bwd_config);
    ctx->save_for_backward({a.query, a.key, a.value, a.bias.value_or(Tensor()), a.mask.value_or(Tensor()),
                            a.query_seq_lengths.value_or(Tensor()), a.key_value_seq_lengths.value_or(Tensor()),
                            a.q_segment_ids.value_or(Tensor()), a.kv_segment_ids.value_or(Tensor()), out, lse});
    return {out, lse};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const AttentionArgs a{saved[0],
                          saved[1],
                          saved[2],
                          Optional(saved[3]),
                          Optional(saved[4]),
                          OptionalDouble(ctx->saved_data["scale"]),
                          ctx->saved_data["is_causal"].toBool(),
                          Optional(saved[5]),
                          Optional(saved[6]),
                          OptionalInts(ctx->saved_data["window"]),
                          OptionalDouble(ctx->saved_data["logits_soft_cap"]),
                          Optional(saved[7]),
                          Optional(saved[8]),
                          /*config=*/std::nullopt,
                          OptionalInts(ctx->saved_data["bwd_config"])};
    const Tensor& out = saved[9];
    const Tensor& lse = saved[10];
    // Only logsumexp may be used downstream: out's cotangent is then zero.
    const Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const bool bias_requires_grad = a.bias.has_value() && ctx->needs_input_grad(3);
    auto [dq, dk, dv, dbias] =
        BackwardOp().call(dout, Optional(grads[1]), a.query, a.key, a.value, a.bias, a.mask, out, lse, a.scale,
                          a.is_causal, a.query_seq_lengths, a.key_value_seq_lengths, Ref(a.local_window_size),
                          a.logits_soft_cap, a.q_segment_ids, a.kv_segment_ids, bias_requires_grad,
                          Ref(a.bwd_config));
    tensor_list result(5);  // one per forward argument: query, key, value, bias, the AttentionArgs
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (bias_requires_grad) result[3] = dbias;
    return result;
  }
};

std::tuple<Tensor, Tensor> DotProductAttentionAutograd(const AttentionArgs& a) {
  if (auto reference = RunReferenceWhereFunctionCannot<std::tuple<Tensor, Tensor>>(
          kOp, a.query, a.key, a.value, a.bias, a.mask, a.scale, a.is_causal, a.query_seq_lengths,
          a.key_value_seq_lengths, a.local_window_size, a.logits_soft_cap, a.q_segment_ids, a.kv_segment_ids, a.config,
          a.bwd_config)) {
    return *reference;
  }
  const tensor_list outputs = DotProductAttentionFunction::apply(a.query, a.key, a.value, a.bias, a);
  return {outputs[0], outputs[1]};
}

// ---- configs for Python: the helper ops' problem (op_kit.h) -------------------------------------

// The call whose configs get_configs / config_space ask for: its shapes, dtype and whether some
// mask lets whole kv tiles be skipped (the masks themselves do not change the configs).
ConfigProblem<DotProductAttentionShape> DotProductAttentionConfigProblem(const Tensor& query, const Tensor& key,
                                                                         const Tensor& value, bool block_sparse) {
  AttentionArgs args;  // no masks, no configs
  args.query = query;
  args.key = key;
  args.value = value;
  DotProductAttentionShape shape = ShapeOf(CheckAttentionArgs(args));
  shape.block_sparse = block_sparse;
  return {shape, ToCoreDType(query.scalar_type(), kOp)};
}

}  // namespace
}  // namespace tokamax

#define TOKAMAX_ATTENTION_ARGS                                                                        \
  "Tensor query, Tensor key, Tensor value, Tensor? bias=None, Tensor? mask=None, float? scale=None, " \
  "bool is_causal=False, Tensor? query_seq_lengths=None, Tensor? key_value_seq_lengths=None, "       \
  "int[]? local_window_size=None, float? logits_soft_cap=None, Tensor? q_segment_ids=None, "         \
  "Tensor? kv_segment_ids=None"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("dot_product_attention(" TOKAMAX_ATTENTION_ARGS
        ", int[]? config=None, int[]? bwd_config=None) -> (Tensor out, Tensor logsumexp)");
  m.def("dot_product_attention_reference(" TOKAMAX_ATTENTION_ARGS
        ", int[]? config=None, int[]? bwd_config=None) -> (Tensor out, Tensor logsumexp)");
  m.def("_dot_product_attention_backward(Tensor dout, Tensor? dlogsumexp, Tensor query, Tensor key, Tensor value, "
        "Tensor? bias, Tensor? mask, Tensor out, Tensor logsumexp, float? scale, bool is_causal, "
        "Tensor? query_seq_lengths, Tensor? key_value_seq_lengths, int[]? local_window_size, "
        "float? logits_soft_cap, Tensor? q_segment_ids, Tensor? kv_segment_ids, bool bias_requires_grad, "
        "int[]? bwd_config) -> (Tensor dquery, Tensor dkey, Tensor dvalue, Tensor dbias)");
  tokamax::DefineConfigOps<&tokamax::DotProductAttentionConfigProblem, &tokamax::DotProductAttentionHeuristicConfig,
                           &tokamax::DotProductAttentionConfigSpace>(
      m, "Tensor query, Tensor key, Tensor value, bool block_sparse=False");
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("dot_product_attention", &tokamax::ForwardEntry<tokamax::DotProductAttentionCpu>);
  m.impl("_dot_product_attention_backward", &tokamax::BackwardEntry<tokamax::DotProductAttentionBackwardCpu>);
}

TORCH_LIBRARY_IMPL(tokamax, CompositeImplicitAutograd, m) {
  m.impl("dot_product_attention_reference", &tokamax::ForwardEntry<tokamax::DotProductAttentionReferenceImpl>);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("dot_product_attention", &tokamax::ForwardEntry<tokamax::DotProductAttentionMeta>);
  m.impl("_dot_product_attention_backward", &tokamax::BackwardEntry<tokamax::DotProductAttentionBackwardMeta>);
}

TORCH_LIBRARY_IMPL(tokamax, Autograd, m) {
  m.impl("dot_product_attention", &tokamax::ForwardEntry<tokamax::DotProductAttentionAutograd>);
}

TORCH_LIBRARY_IMPL(tokamax, AutocastCPU, m) {
  tokamax::RegisterLowerPrecisionAutocast(m, {"dot_product_attention", "dot_product_attention_reference"});
}
