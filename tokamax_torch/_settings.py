"""Library settings: ``tokamax_torch.config``. Each setting starts from an environment variable."""

from __future__ import annotations

import os

CACHE_MISS_CHOICES = ("heuristics", "warn", "error")


class Settings:
    """``autotuning_cache_miss``: what ``get_configs(..., from_autotuning_cache=True)`` does on a
    miss: fall back to the heuristics silently (``"heuristics"``, the default), fall back with a
    warning (``"warn"``), or raise ``LookupError`` (``"error"``). Environment variable:
    ``TOKAMAX_TORCH_AUTOTUNING_CACHE_MISS``.

    ``cache_dir``: the user autotuning cache, overlaying the shipped one. Environment variable:
    ``TOKAMAX_TORCH_CACHE_DIR``; default ``~/.cache/tokamax_torch``.
    """

    def __init__(self) -> None:
        self.autotuning_cache_miss = os.environ.get("TOKAMAX_TORCH_AUTOTUNING_CACHE_MISS", "heuristics")
        self.cache_dir = os.environ.get("TOKAMAX_TORCH_CACHE_DIR") or os.path.join(
            os.path.expanduser("~"), ".cache", "tokamax_torch")

    def __setattr__(self, name: str, value) -> None:
        if name == "autotuning_cache_miss" and value not in CACHE_MISS_CHOICES:
            raise ValueError(f"tokamax_torch.config.autotuning_cache_miss must be one of "
                             f"{CACHE_MISS_CHOICES}, got {value!r}")
        if name not in ("autotuning_cache_miss", "cache_dir"):
            raise AttributeError(f"tokamax_torch.config has no setting {name!r}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return (f"tokamax_torch.config(autotuning_cache_miss={self.autotuning_cache_miss!r}, "
                f"cache_dir={self.cache_dir!r})")


config = Settings()
