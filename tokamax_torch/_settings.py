"""Library settings: ``tokamax_torch.config``. Each setting starts from an environment variable."""

from __future__ import annotations

import os
import warnings

CACHE_MISS_CHOICES = ("heuristics", "warn", "error")


class Settings:
    """``autotuning_cache_miss``: what ``get_configs(..., from_autotuning_cache=True)`` does on a
    miss: fall back to the heuristics silently (``"heuristics"``, the default), fall back with a
    warning (``"warn"``), or raise ``LookupError`` (``"error"``). Environment variable:
    ``TOKAMAX_TORCH_AUTOTUNING_CACHE_MISS``.

    ``cache_dir``: the user autotuning cache, overlaying the shipped one. Environment variable:
    ``TOKAMAX_TORCH_CACHE_DIR``; default ``~/.cache/tokamax_torch``; ``~`` is expanded.

    An empty environment variable means the default. A bad value in one warns, naming the
    variable, and keeps the default: a lookup setting must not stop ``import tokamax_torch``.
    Setting a bad value on ``tokamax_torch.config`` raises.
    """

    def __init__(self) -> None:
        self.autotuning_cache_miss = "heuristics"
        self.cache_dir = os.path.join("~", ".cache", "tokamax_torch")
        for name, variable in (("autotuning_cache_miss", "TOKAMAX_TORCH_AUTOTUNING_CACHE_MISS"),
                               ("cache_dir", "TOKAMAX_TORCH_CACHE_DIR")):
            value = os.environ.get(variable, "")
            if not value:
                continue
            try:
                setattr(self, name, value)
            except ValueError as exc:
                warnings.warn(f"{variable}={value!r} ignored: {exc}", stacklevel=2)

    def __setattr__(self, name: str, value) -> None:
        if name == "autotuning_cache_miss" and value not in CACHE_MISS_CHOICES:
            raise ValueError(f"tokamax_torch.config.autotuning_cache_miss must be one of "
                             f"{CACHE_MISS_CHOICES}, got {value!r}")
        if name == "cache_dir":
            if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
                raise ValueError(f"tokamax_torch.config.cache_dir must be a non-empty path, got {value!r}")
            value = os.path.expanduser(os.fspath(value))
        if name not in ("autotuning_cache_miss", "cache_dir"):
            raise AttributeError(f"tokamax_torch.config has no setting {name!r}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return (f"tokamax_torch.config(autotuning_cache_miss={self.autotuning_cache_miss!r}, "
                f"cache_dir={self.cache_dir!r})")


config = Settings()
