"""topk: exact top-k indices of Tokamax.

``topk(scores[b, n], k, row_lengths=None, *, return_scores=False) -> (indices int32[b, k], values)``:
each row's k largest eligible scores, descending, ties to the lower index; eligible means column
``< clamp(row_lengths[r], 0, n)`` and score ``> -inf`` (NaN never is). A row with fewer than k
eligible scores is padded with index -1 (a suffix) and, in ``values``, -inf. ``values`` (the
selected scores, scores' dtype) is None unless ``return_scores``. The math and checks live in
C++ (``csrc/torch/topk.cc``, ``csrc/ops/topk/``).
"""

from __future__ import annotations

from typing import Optional

import torch

from tokamax_torch import _op


class _TopK(_op.Op):
    """A topk implementation; ``reference`` and ``kernel`` share this signature."""

    family = "topk"
    summary = "Exact top-k indices per row with ragged row lengths and -1 padding, ties to the lower index."

    def __call__(self, scores: torch.Tensor, k: int, row_lengths: Optional[torch.Tensor] = None, *,
                 return_scores: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """row_lengths may be given by position (as upstream), so torch.export sees it as an input."""
        return_scores = _op.scalar_flag(self.family, "return_scores", return_scores)
        indices, values = self._op(scores, _op.scalar_int(self.family, "k", k), row_lengths, return_scores)
        return indices, (values if return_scores else None)


reference = _TopK("reference", torch.ops.tokamax.topk_reference.default)
kernel = _TopK("kernel", torch.ops.tokamax.topk.default)

__all__ = ["kernel", "reference"]
