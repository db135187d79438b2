"""router_topk: the sort-free mixture-of-experts router top-k of Tokamax.

``router_topk(scores[T, E], k) -> (weights fp32[T, k], indices int32[T, k])``: each row's k largest
scores, descending, and their expert ids; the weights are the raw selected scores (no softmax, no
renormalisation, as upstream). Ties go to the lowest id; NaN and scores <= -3e38 (-inf,
-FLT_MAX) count as -3e38, so they never beat a good score and fill a short row as weight -3e38
on the lowest unselected ids; a row with no good score has NaN weights and ids 0..k-1. The math
and checks live in C++ (``csrc/torch/router_topk.cc``, ``csrc/ops/topk/``).
"""

from __future__ import annotations

import torch

from tokamax_torch import _op


class _RouterTopK(_op.Op):
    """A router_topk implementation; ``reference`` and ``kernel`` share this signature."""

    family = "router_topk"
    summary = "MoE router top-k: each row's k largest scores (raw, fp32) and expert ids, ties to the lowest id."

    def __call__(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._op(scores, _op.scalar_int(self.family, "k", k))


reference = _RouterTopK("reference", torch.ops.tokamax.router_topk_reference.default)
kernel = _RouterTopK("kernel", torch.ops.tokamax.router_topk.default)

__all__ = ["kernel", "reference"]
