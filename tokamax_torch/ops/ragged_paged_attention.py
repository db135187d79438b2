"""ragged_paged_attention (upstream ``batched_rpa``): decode, prefill and mixed sequences against a
paged KV cache in one call, after writing the new tokens' keys and values into the cache.

``ragged_paged_attention(queries[T,Hq,D], keys[T,Hkv,D], values[T,Hkv,D],
kv_cache[total_pages, page_size, 2*Hkv, D], kv_lens[S], page_indices[S*pages_per_seq],
cu_q_lens[S+1], distribution[3], *, ...) -> (out[T,Hq,D], kv_cache)``, or
``(out, kv_cache, lse[T,Hq] fp32)`` with ``return_lse=True`` (upstream's order).

``kv_cache`` is donated: written in place and returned (same storage), never copied, under
``torch.compile`` too (docs/design.md, "Buffer donation"). K and V are interleaved per head
(merged head 2h is K of kv head h, 2h+1 its V, as ``kv_cache_update`` writes them). The math and
the checks live in C++ (``csrc/torch/ragged_paged_attention.cc``,
``csrc/ops/ragged_paged_attention/``); docs/ops.md has the semantics and every error.
"""

from __future__ import annotations

from typing import Optional

import torch

from tokamax_torch import _op
from tokamax_torch import configs as _configs

#: Tiling of the CPU kernel; its fields come from ``tokamax::RaggedPagedAttentionConfig``.
Config = _configs.config_class("ragged_paged_attention", __name__, "Tiling of the ragged_paged_attention CPU kernel.")
#: The forward call (the op has no backward).
PRODUCTS = _configs.products("ragged_paged_attention")

_INDEX_ARGS = ("kv_lens", "page_indices", "cu_q_lens", "distribution")


class _RaggedPagedAttention(_op.Op):
    """A ragged_paged_attention implementation; ``reference`` and ``kernel`` share this signature."""

    family = "ragged_paged_attention"
    product_specs = _op.declared_products(PRODUCTS, wrt={})
    config_cls = Config
    donated_args = ("kv_cache",)
    summary = ("Ragged paged attention (upstream batched_rpa): decode, prefill and mixed sequences against a "
               "paged KV cache `[pages, page_size, 2*Hkv, D]`, GQA, causal, sliding window, soft cap; the new "
               "tokens written into the cache first (donated and returned).")
    cli_shape = "T,S,PAGES_PER_SEQ,PAGE_SIZE,HQ,HKV,D"

    def __call__(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_cache: torch.Tensor,
                 kv_lens: torch.Tensor, page_indices: torch.Tensor, cu_q_lens: torch.Tensor,
                 distribution: torch.Tensor, *, use_causal_mask: bool = True, sm_scale: Optional[float] = None,
                 sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                 mask_value: Optional[float] = None, out_dtype: Optional[torch.dtype] = None,
                 skip_kv_update: bool = False, return_lse: bool = False, configs=None):
        """sm_scale=None means 1.0 (upstream's default); mask_value=None drops masked keys."""
        fwd, _ = self._split_configs(configs)
        f = self.family
        (out, lse), kv_cache = self._call_donating(
            queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
            _op.scalar_flag(f, "use_causal_mask", use_causal_mask), _op.scalar_float(f, "sm_scale", sm_scale, optional=True),
            _op.scalar_int(f, "sliding_window", sliding_window, optional=True),
            _op.scalar_float(f, "soft_cap", soft_cap, optional=True),
            _op.scalar_float(f, "mask_value", mask_value, optional=True), out_dtype,
            _op.scalar_flag(f, "skip_kv_update", skip_kv_update), _configs.config_to_list(fwd))
        return (out, kv_cache, lse) if _op.scalar_flag(f, "return_lse", return_lse) else (out, kv_cache)

    def donated_outputs(self, result) -> tuple:
        return (result[1],)

    def canonicalize(self, arguments: dict) -> dict:
        for name in ("sm_scale", "soft_cap", "mask_value"):
            arguments[name] = _op.scalar_float(self.family, name, arguments[name], optional=True)
        arguments["sliding_window"] = _op.scalar_int(self.family, "sliding_window", arguments["sliding_window"],
                                                     optional=True)
        for name in ("use_causal_mask", "skip_kv_update", "return_lse"):
            arguments[name] = _op.scalar_flag(self.family, name, arguments[name])
        return arguments

    def config_op_arguments(self, bound) -> tuple:
        return (bound["queries"], bound["keys"], bound["values"], bound["kv_cache"],
                *(bound[name] for name in _INDEX_ARGS))

    def cache_key_arguments(self, bound) -> dict:
        """The sizes decide the fastest config; the options and the index values do not enter the key."""
        return {name: bound[name] for name in ("queries", "keys", "kv_cache", "kv_lens", "page_indices")}

    def cli_call(self, shape: str, dtype: torch.dtype, options):
        """A batch of S sequences sharing T tokens, each owning PAGES_PER_SEQ pages (meta tensors;
        the autotuner fills the indices with a valid mixed batch, real_argument)."""
        try:
            t, s, pages_per_seq, page_size, hq, hkv, d = (int(v) for v in shape.split(","))
        except ValueError:
            raise ValueError(f"--shape must be {self.cli_shape} (seven ints), got {shape!r}") from None
        meta = dict(device="meta", dtype=dtype)
        index = dict(device="meta", dtype=torch.int32)
        return self.bind(torch.empty(t, hq, d, **meta), torch.empty(t, hkv, d, **meta), torch.empty(t, hkv, d, **meta),
                         torch.empty(s * pages_per_seq, page_size, 2 * hkv, d, **meta), torch.empty(s, **index),
                         torch.empty(s * pages_per_seq, **index), torch.empty(s + 1, **index),
                         torch.empty(3, **index))

    def real_argument(self, bound, name: str, value, generator: torch.Generator):
        """Meta index tensors become a valid batch for the autotuner: every sequence active (mixed),
        T tokens spread over them, each owning distinct pages and a full cache."""
        if not isinstance(value, torch.Tensor) or value.device.type != "meta" or name not in _INDEX_ARGS:
            return super().real_argument(bound, name, value, generator)
        seqs = bound["kv_lens"].shape[0]
        tokens = bound["queries"].shape[0]
        total_pages, page_size = bound["kv_cache"].shape[:2]
        pages_per_seq = bound["page_indices"].shape[0] // max(seqs, 1)
        usable = min(pages_per_seq, total_pages // max(seqs, 1))
        cu = torch.arange(seqs + 1) * tokens // max(seqs, 1)
        if name == "cu_q_lens":
            return cu.to(value.dtype)
        if name == "kv_lens":
            return torch.maximum(torch.full((seqs,), usable * page_size), cu.diff()).to(value.dtype)
        if name == "distribution":
            return torch.tensor([0, 0, seqs], dtype=value.dtype)
        seq = torch.arange(seqs).repeat_interleave(pages_per_seq)
        page = torch.arange(pages_per_seq).repeat(seqs)
        return (seq * usable + page.clamp(max=max(usable - 1, 0))).clamp(max=max(total_pages - 1, 0)).to(value.dtype)


reference = _RaggedPagedAttention("reference", torch.ops.tokamax.ragged_paged_attention_reference.default)
kernel = _RaggedPagedAttention("kernel", torch.ops.tokamax.ragged_paged_attention.default)

__all__ = ["Config", "kernel", "reference"]
