// tokamax::kv_cache_update and its reference: the schema (kv_cache donated: Tensor(a!), nothing
// returned; the Python singleton returns kv_cache itself), the one argument check, the CPU kernel,
// the ATen reference and the Meta kernel. No configs, no autograd (it writes state).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "csrc/ops/kv_cache_update/kv_cache_update.h"
#include "csrc/torch/adapter_utils.h"

namespace tokamax {
namespace {

using at::Tensor;
constexpr const char* kOp = "kv_cache_update";

// Shapes, dtypes and the cache's row stride, from metadata only (Meta kernels call it too, so
// eager and compiled code raise the same errors). Sizes compare symbolically.
void CheckKvCacheUpdateArgs(const Tensor& kv_cache, const Tensor& keys, const Tensor& values,
                            const Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 4, kOp, ": kv_cache must be 4-D [total_pages, page_size, 2*Hkv, D], got shape ",
              ShapeString(kv_cache));
  TORCH_CHECK(keys.dim() == 3, kOp, ": keys must be 3-D [T, Hkv, D], got shape ", ShapeString(keys));
  TORCH_CHECK(values.dim() == 3, kOp, ": values must be 3-D [T, Hkv, D], got shape ", ShapeString(values));
  TORCH_CHECK(slot_mapping.dim() == 1, kOp, ": slot_mapping must be 1-D [T], got shape ", ShapeString(slot_mapping));
  TORCH_CHECK(IsSupportedFloat(kv_cache.scalar_type()), kOp,
              ": kv_cache must be float32, bfloat16, float16 or float64, got ", kv_cache.scalar_type());
  // No conversion: a cast on the way into the cache would hide a loss of precision.
  TORCH_CHECK(keys.scalar_type() == kv_cache.scalar_type(), kOp, ": keys must have kv_cache's dtype ",
              kv_cache.scalar_type(), ", got ", keys.scalar_type());
  TORCH_CHECK(values.scalar_type() == kv_cache.scalar_type(), kOp, ": values must have kv_cache's dtype ",
              kv_cache.scalar_type(), ", got ", values.scalar_type());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong, kOp,
              ": slot_mapping must be int32 or int64, got ", slot_mapping.scalar_type());
  for (const Tensor* t : {&keys, &values, &slot_mapping}) {
    TORCH_CHECK(t->device() == kv_cache.device(), kOp, ": every tensor must be on kv_cache's device ",
                kv_cache.device(), ", got ", t->device());
  }
  TORCH_SYM_CHECK(values.sym_size(0).sym_eq(keys.sym_size(0)).sym_and(values.sym_size(1).sym_eq(keys.sym_size(1)))
                      .sym_and(values.sym_size(2).sym_eq(keys.sym_size(2))),
                  kOp, ": values must have keys' shape ", ShapeString(keys), ", got shape ", ShapeString(values));
  TORCH_SYM_CHECK(slot_mapping.sym_size(0).sym_eq(keys.sym_size(0)), kOp,
                  ": slot_mapping must have one slot per token, [T] = [", keys.sym_size(0), "], got shape ",
                  ShapeString(slot_mapping));
  TORCH_SYM_CHECK(kv_cache.sym_size(2).sym_eq(keys.sym_size(1) * 2), kOp,
                  ": kv_cache.shape[2] must be 2*Hkv = ", keys.sym_size(1) * 2, " (K and V of each of keys' ",
                  keys.sym_size(1), " heads), got kv_cache shape ", ShapeString(kv_cache));
  TORCH_SYM_CHECK(kv_cache.sym_size(3).sym_eq(keys.sym_size(2)), kOp, ": kv_cache.shape[3] must be keys' D = ",
                  keys.sym_size(2), ", got kv_cache shape ", ShapeString(kv_cache));
  // Rows are copied whole (memcpy): the cache's last dimension must be contiguous.
  TORCH_SYM_CHECK(kv_cache.sym_stride(3).sym_eq(1).sym_or(kv_cache.sym_size(3).sym_le(1)), kOp,
                  ": kv_cache must have a contiguous last dimension (stride 1), got strides ", kv_cache.sym_strides());
}

// The checks of real tensors both CPU implementations make before writing: no aliasing of the
// donated cache, every slot valid (range, no duplicate).
void CheckBeforeWrite(const Tensor& kv_cache, const Tensor& keys, const Tensor& values, const Tensor& slot_mapping,
                      const KvCacheSlots& slots) {
  CheckDonatedBuffer(kOp, "kv_cache", kv_cache, {{"keys", &keys}, {"values", &values}, {"slot_mapping", &slot_mapping}});
  const Status status = CheckKvCacheSlots(slots, kv_cache.size(0) * kv_cache.size(1));
  TORCH_CHECK(status.ok(), status.message());
}

KvCacheSlots SlotsOf(const Tensor& slot_mapping) {
  KvCacheSlots slots;
  slots.data = slot_mapping.const_data_ptr();
  slots.is_int64 = slot_mapping.scalar_type() == at::kLong;
  slots.count = slot_mapping.size(0);
  slots.stride = slot_mapping.stride(0);
  return slots;
}

void KvCacheUpdateCpu(const Tensor& kv_cache, const Tensor& keys, const Tensor& values, const Tensor& slot_mapping) {
  CheckKvCacheUpdateArgs(kv_cache, keys, values, slot_mapping);
  KvCacheUpdateParams params;
  params.slots = SlotsOf(slot_mapping);
  CheckBeforeWrite(kv_cache, keys, values, slot_mapping, params.slots);
  params.cache = MutableStridedViewOf<4>(kv_cache, kOp);
  params.keys = StridedViewOf<3>(keys, kOp);
  params.values = StridedViewOf<3>(values, kOp);
  const Status status = KvCacheUpdate(params);
  TORCH_CHECK(status.ok(), status.message());
}

// Plain ATen: the valid tokens' K and V rows interleaved per head, index_put_ at (page, offset).
void KvCacheUpdateReference(const Tensor& kv_cache, const Tensor& keys, const Tensor& values,
                            const Tensor& slot_mapping) {
  CheckKvCacheUpdateArgs(kv_cache, keys, values, slot_mapping);
  CheckBeforeWrite(kv_cache, keys, values, slot_mapping, SlotsOf(slot_mapping));
  const Tensor tokens = slot_mapping.ge(0).nonzero().squeeze(1);
  const Tensor slots = slot_mapping.index_select(0, tokens).to(at::kLong);
  const int64_t page_size = kv_cache.size(1);
  const Tensor rows = at::stack({keys.index_select(0, tokens), values.index_select(0, tokens)}, 2)
                          .reshape({tokens.size(0), kv_cache.size(2), kv_cache.size(3)});
  const_cast<Tensor&>(kv_cache).index_put_({slots.div(page_size, "floor"), slots.remainder(page_size)}, rows);
}

void KvCacheUpdateMeta(const Tensor& kv_cache, const Tensor& keys, const Tensor& values, const Tensor& slot_mapping) {
  CheckKvCacheUpdateArgs(kv_cache, keys, values, slot_mapping);
  CheckDonatedBuffer(kOp, "kv_cache", kv_cache, {});
}

}  // namespace
}  // namespace tokamax

// kv_cache is donated: written in place (a!), returned by the Python singleton, not by the op
// (a custom op may not return an alias of its input; functionalization reinplaces a `-> ()` op).
#define TOKAMAX_KV_CACHE_UPDATE_ARGS "(Tensor(a!) kv_cache, Tensor keys, Tensor values, Tensor slot_mapping) -> ()"

TORCH_LIBRARY_FRAGMENT(tokamax, m) {
  m.def("kv_cache_update" TOKAMAX_KV_CACHE_UPDATE_ARGS);
  m.def("kv_cache_update_reference" TOKAMAX_KV_CACHE_UPDATE_ARGS);
}

TORCH_LIBRARY_IMPL(tokamax, CPU, m) {
  m.impl("kv_cache_update", &tokamax::KvCacheUpdateCpu);
  m.impl("kv_cache_update_reference", &tokamax::KvCacheUpdateReference);
}

TORCH_LIBRARY_IMPL(tokamax, Meta, m) {
  m.impl("kv_cache_update", &tokamax::KvCacheUpdateMeta);
  m.impl("kv_cache_update_reference", &tokamax::KvCacheUpdateMeta);
}
