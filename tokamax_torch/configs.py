"""Kernel configs: frozen dataclasses built at import from the C++ field lists.

Each op writes its Config's fields once, in C++ (an X-macro in ``csrc/ops/<op>/<op>.h``, see
``csrc/core/base/config_fields.h``). The library's ``_<op>_config_fields`` op reports the field names
in the order the schema's ``int[]`` takes them, a description of each, and the op's products;
``config_class`` makes the op's ``Config`` dataclass from them, so no field name is written in
Python and the two cannot drift. Every instance is validated by the C++ ``Validate()`` when it is
made, so an invalid config fails where it is written, not inside a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable

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
