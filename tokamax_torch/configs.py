"""Kernel configs: frozen dataclasses built at import from the C++ field lists.

Each op writes its Config's fields once, in C++ (an X-macro in ``csrc/ops/<op>/<op>.h``, see
``csrc/core/config_fields.h``). The library's ``_<op>_config_fields`` op reports the field names
in the order the schema's ``int[]`` takes them, a description of each, and the op's products;
``config_class`` makes the op's ``Config`` dataclass from them, so no field name is written in
Python and the two cannot drift. Every instance is validated by the C++ ``Validate()`` when it is
made, so an invalid config fails where it is written, not inside a kernel.

``OpSingleton`` is the config plumbing the ``reference`` and ``kernel`` singletons of every op
family share.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Optional, Sequence

import torch


@functools.lru_cache(maxsize=None)
def _describe(op: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(field names, field descriptions, product names) of `op`, as the library reports them."""
    names, docs, products = getattr(torch.ops.tokamax, f"_{op}_config_fields")()
    return tuple(names), tuple(docs), tuple(products)


def products(op: str) -> dict[str, int]:
    """The products of `op` (the calls configured and tuned separately), each with the id the
    ``_<op>_heuristic_config`` / ``_<op>_config_space`` ops take, in the C++ order."""
    return {name: index for index, name in enumerate(_describe(op)[2])}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def config_class(op: str, module: str, summary: str) -> type:
    """The frozen dataclass ``Config`` of `op`'s kernel, one int field per C++ field, in order.

    It lives in `module` (where the caller binds it to ``Config``, so it pickles), takes its
    fields positionally or by keyword (an unknown or missing field is a TypeError), checks each
    value is an int and runs the C++ validation, and has ``to_list()`` / ``from_list()`` for the
    schema's int[] besides the dataclass repr, equality and hash.
    """
    names, docs, _ = _describe(op)
    validate = getattr(torch.ops.tokamax, f"_{op}_validate_config")

    def __post_init__(self) -> None:
        for name in names:
            value = getattr(self, name)
            if not _is_int(value):
                raise TypeError(f"{type(self).__name__}.{name} must be an int, got {type(value).__name__}")
        validate(self.to_list())

    def to_list(self) -> list[int]:
        """The values in field order: the int[] the op's schema takes."""
        return [getattr(self, name) for name in names]

    def from_list(cls, values: Iterable[int]):
        """The Config whose ``to_list()`` is `values`."""
        values = list(values)
        if len(values) != len(names):
            raise ValueError(f"{op} config: expected {len(names)} values ({', '.join(names)}), got {len(values)}")
        return cls(*values)

    cls = dataclasses.make_dataclass(
        "Config",
        [(name, int) for name in names],
        frozen=True,
        namespace={"__post_init__": __post_init__, "to_list": to_list, "from_list": classmethod(from_list)},
    )
    cls.__module__ = module
    fields = "\n".join(f"    {name}: {doc}" for name, doc in zip(names, docs))
    cls.__doc__ = f"{summary}\n\nFields, in the order of ``to_list()`` (from the C++ field list):\n\n{fields}\n"
    return cls


def config_to_list(config) -> list[int] | None:
    """A Config, a sequence of ints or None, as the optional int[] the schema takes."""
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        return config.to_list()
    if isinstance(config, (str, bytes)) or not all(_is_int(v) for v in config):
        raise TypeError(f"a config must be a Config, a sequence of ints or None, got {config!r}")
    return list(config)


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
        return [self.config_cls.from_list(flat[i : i + n]) for i in range(0, len(flat), n)]
