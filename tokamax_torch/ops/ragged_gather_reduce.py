"""ragged_gather_reduce: the MoE combine.

``ragged_gather_reduce(x[R, H], indices[N], topk_weights[N], valid_rows_mask bool[N],
reduce_group_size) -> [N / reduce_group_size, H]``: token t's output is the sum, over its group
``j in [t*g, (t+1)*g)`` in ascending order, of ``topk_weights[j] * x[indices[j]]`` where
``valid_rows_mask[j]`` (invalid rows add exactly zero and their indices are not read), in fp32
(float64 for float64 x), stored in x's dtype. Upstream's signature and math. Differentiable in x
and topk_weights; the math, checks and autograd live in C++ (``csrc/torch/ragged_gather_reduce.cc``,
``csrc/ops/moe_gather/``).
"""

from __future__ import annotations

import torch

from tokamax_torch import _op


class _RaggedGatherReduce(_op.Op):
    """A ragged_gather_reduce implementation; ``reference`` and ``kernel`` share this signature."""

    family = "ragged_gather_reduce"
    summary = ("MoE combine: each token's fp32 sum of its `reduce_group_size` gathered rows of x, weighted "
               "and masked, with its backward.")

    def __call__(self, x: torch.Tensor, indices: torch.Tensor, topk_weights: torch.Tensor,
                 valid_rows_mask: torch.Tensor, reduce_group_size: int) -> torch.Tensor:
        return self._op(x, indices, topk_weights, valid_rows_mask, reduce_group_size)


reference = _RaggedGatherReduce("reference", torch.ops.tokamax.ragged_gather_reduce_reference.default)
kernel = _RaggedGatherReduce("kernel", torch.ops.tokamax.ragged_gather_reduce.default)

__all__ = ["kernel", "reference"]
