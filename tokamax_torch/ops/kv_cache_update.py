"""kv_cache_update: writes new tokens' keys and values into a paged KV cache, in place.

``kv_cache`` is donated: the op writes it in place and returns it (same storage); under
``torch.compile`` no copy of it is made (docs/design.md, "Buffer donation"). No configs.
"""

from __future__ import annotations

import torch

from tokamax_torch import _op


class _KvCacheUpdate(_op.Op):
    family = "kv_cache_update"
    donated_args = ("kv_cache",)
    summary = ("Writes T tokens' keys and values into a paged KV cache `[pages, page_size, 2*Hkv, D]` "
               "at `slot_mapping` (-1 skips), in place: the cache is donated and returned.")

    def __call__(self, kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 slot_mapping: torch.Tensor) -> torch.Tensor:
        return self._call_donating(kv_cache, keys, values, slot_mapping)


reference = _KvCacheUpdate("reference", torch.ops.tokamax.kv_cache_update_reference.default)
kernel = _KvCacheUpdate("kernel", torch.ops.tokamax.kv_cache_update.default)

__all__ = ["reference", "kernel"]
