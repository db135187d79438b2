"""Kernel configs: frozen dataclasses that mirror the C++ Config structs field for field.

The C++ struct is the source of truth: each op's Python Config is checked at import against
the field names the library reports, and every instance is validated by the C++ Validate()
when it is made, so an invalid config fails where it is written, not inside a kernel.

``OpSingleton`` is the config plumbing the ``reference`` and ``kernel`` singletons of every op
family share.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch


def check_fields_match(cls: type, cpp_fields: Sequence[str]) -> None:
    """Raises ImportError when a Python Config drifts from its C++ struct."""
    py_fields = [f.name for f in dataclasses.fields(cls)]
    if py_fields != list(cpp_fields):
        raise ImportError(
            f"{cls.__module__}.{cls.__qualname__} fields {py_fields} do not match the C++ "
            f"config fields {list(cpp_fields)}; rebuild the library or update the dataclass"
        )


def config_to_list(config) -> list[int] | None:
    """A Config, a sequence of ints or None, as the optional int[] the schema takes."""
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        return config.to_list()
    if isinstance(config, (str, bytes)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in config):
        raise TypeError(f"a config must be a Config, a sequence of ints or None, got {config!r}")
    return list(config)


def make_validator(validate_op: Callable[[list[int]], None]):
    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"{type(self).__name__}.{field.name} must be an int, got {type(value).__name__}"
                )
        validate_op(self.to_list())

    return __post_init__


def tensor_spec(t: Optional[torch.Tensor]) -> Optional[dict]:
    """A tensor's shape and dtype, as autotuning cache keys hold them."""
    if t is None:
        return None
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


class OpSingleton:
    """What the ``reference`` and ``kernel`` singletons of an op family share.

    A subclass sets ``family`` (the op family: the kernel op's name in ``torch.ops.tokamax``, and
    the name in cache files and on the autotuning command line), ``product_ids`` (the products an
    autotuner tunes separately, each with the id the config ops take) and ``config_cls``.
    """

    family: str
    product_ids: dict[str, int]
    config_cls: type

    def __init__(self, name: str, op) -> None:
        self.name = name
        self._op = op

    @property
    def products(self) -> tuple[str, ...]:
        return tuple(self.product_ids)

    @property
    def tunable(self) -> bool:
        return self._op is getattr(torch.ops.tokamax, self.family).default

    @property
    def op(self):
        """The registered ``torch.ops.tokamax`` overload this singleton calls."""
        return self._op

    def __repr__(self) -> str:
        return f"tokamax_torch.ops.{self.family}.{self.name}"

    def _split_configs(self, configs) -> tuple:
        """``configs=(fwd, bwd)`` or None, as the pair (fwd, bwd)."""
        if configs is None:
            return None, None
        if not isinstance(configs, (tuple, list)) or len(configs) != 2:
            raise TypeError(f"{self.family}: configs must be a (fwd, bwd) pair or None, got {configs!r}")
        return configs[0], configs[1]

    def _check_product(self, product: str) -> int:
        """The id of `product` for the config ops; ValueError for an unknown product."""
        if product not in self.product_ids:
            raise ValueError(f"{self.family}: product must be one of {list(self.product_ids)}, got {product!r}")
        return self.product_ids[product]

    def _configs_from_flat(self, flat: Sequence[int]) -> list:
        """The configs a ``_<op>_config_space`` op returns, concatenated in field order."""
        n = len(dataclasses.fields(self.config_cls))
        return [self.config_cls(*flat[i : i + n]) for i in range(0, len(flat), n)]
