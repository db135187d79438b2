"""Kernel configs: frozen dataclasses that mirror the C++ Config structs field for field.

The C++ struct is the source of truth: each op's Python Config is checked at import against
the field names the library reports, and every instance is validated by the C++ Validate()
when it is made, so an invalid config fails where it is written, not inside a kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence


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
