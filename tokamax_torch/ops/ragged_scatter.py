"""ragged_scatter: a row gather that keeps the rows whose index lies in ``[start, end)``.

``ragged_scatter(x[R, H], indices[N], start, end) -> [N, H]``: ``out[j] = x[indices[j]]`` where
``start <= indices[j] < end``, a zero row elsewhere (openxla/tokamax main's semantics: the rows
of x this shard holds, ``0 <= start <= end <= R``). ``start`` and ``end`` are int32/int64 tensors
of one element. Differentiable in x; the math, checks and autograd live in C++
(``csrc/torch/ragged_gather.cc``, ``csrc/ops/moe_gather/``).
"""

from __future__ import annotations

import torch

from tokamax_torch import _op


class _RaggedScatter(_op.Op):
    """A ragged_scatter implementation; ``reference`` and ``kernel`` share this signature."""

    family = "ragged_scatter"
    summary = ("`out[j] = x[indices[j]]` where `start <= indices[j] < end`, zero rows elsewhere, "
               "with its backward.")

    def __call__(self, x: torch.Tensor, indices: torch.Tensor, start: torch.Tensor,
                 end: torch.Tensor) -> torch.Tensor:
        return self._op(x, indices, start, end)


reference = _RaggedScatter("reference", torch.ops.tokamax.ragged_scatter_reference.default)
kernel = _RaggedScatter("kernel", torch.ops.tokamax.ragged_scatter.default)

__all__ = ["kernel", "reference"]
