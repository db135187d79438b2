"""One module per op family, each with ``reference``, ``kernel`` and ``Config``."""

from tokamax_torch.ops import ragged_dot

__all__ = ["ragged_dot"]
