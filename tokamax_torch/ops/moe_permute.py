"""moe_permute: the glue between a router and ragged_dot.

``moe_permute(expert_indices[T, k], num_experts) -> (order int64[T*k], inverse int64[T*k],
group_sizes int32[num_experts])``: ``order`` lists the flattened (token, slot) positions ``t*k + s``
sorted by expert id, stable (equal ids keep flattened order); ``inverse[order[i]] = i``;
``group_sizes[e]`` counts id e. So ``x[order // k]`` holds each expert's rows contiguously for
ragged_dot, and ``y[inverse]`` puts its rows back in (token, slot) order. Ids outside
``[0, num_experts)`` raise before anything is written. No gradient, no configs; the math and
checks live in C++ (``csrc/torch/moe_permute.cc``, ``csrc/ops/moe_gather/``).
"""

from __future__ import annotations

import torch

from tokamax_torch import _op


class _MoePermute(_op.Op):
    """A moe_permute implementation; ``reference`` and ``kernel`` share this signature."""

    family = "moe_permute"
    summary = ("MoE permutation: (token, slot) positions sorted by expert (stable), the inverse, and "
               "int32 group_sizes for ragged_dot.")

    def __call__(self, expert_indices: torch.Tensor,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._op(expert_indices, num_experts)


reference = _MoePermute("reference", torch.ops.tokamax.moe_permute_reference.default)
kernel = _MoePermute("kernel", torch.ops.tokamax.moe_permute.default)

__all__ = ["kernel", "reference"]
