"""One module per op family, each with ``reference``, ``kernel`` and ``Config``."""

from tokamax_torch.ops import dot_product_attention, ragged_dot

__all__ = ["dot_product_attention", "ragged_dot"]
