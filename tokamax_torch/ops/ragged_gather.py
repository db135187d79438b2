"""ragged_gather: the rows ``[start, end)`` of a row gather (the MoE dispatch).

``ragged_gather(x[R, H], indices[N], start, end) -> [N, H]``: ``out[j] = x[indices[j]]`` for
``start <= j < end``, a zero row elsewhere (whose index is never read). ``start`` and ``end`` are
int32/int64 tensors of one element, as upstream, with ``0 <= start <= end <= N``. Upstream
defines only the rows ``[start, end)``; here the others are zeros. Differentiable in x; the math,
checks and autograd live in C++ (``csrc/torch/ragged_gather.cc``, ``csrc/ops/moe_gather/``).
"""

from __future__ import annotations

import torch

from tokamax_torch import _op


class _RaggedGather(_op.Op):
    """A ragged_gather implementation; ``reference`` and ``kernel`` share this signature."""

    family = "ragged_gather"
    summary = "MoE dispatch: `out[j] = x[indices[j]]` for `start <= j < end`, zero rows elsewhere, with its backward."

    def __call__(self, x: torch.Tensor, indices: torch.Tensor, start: torch.Tensor,
                 end: torch.Tensor) -> torch.Tensor:
        return self._op(x, indices, start, end)


reference = _RaggedGather("reference", torch.ops.tokamax.ragged_gather_reference.default)
kernel = _RaggedGather("kernel", torch.ops.tokamax.ragged_gather.default)

__all__ = ["kernel", "reference"]
