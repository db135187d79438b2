"""Autotuning: the on-disk config cache (a sideband the op never reads) and the autotuner."""

from tokamax_torch.autotuning.autotuner import AutotuningResult, autotune, lookup_configs
from tokamax_torch.autotuning.cache import FORMAT, ConfigCache

__all__ = ["AutotuningResult", "ConfigCache", "FORMAT", "autotune", "lookup_configs"]
