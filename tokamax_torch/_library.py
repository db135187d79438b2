"""Loads the compiled operator library (``_C.so``) that registers the ``tokamax::`` ops."""

import pathlib

import torch

_LIBRARY_PATH = pathlib.Path(__file__).with_name("_C.so")


def load() -> None:
    if not _LIBRARY_PATH.exists():
        raise ImportError(
            f"tokamax_torch: the compiled library {_LIBRARY_PATH} is missing; build it with "
            "`pip install --no-build-isolation -e .` (see README.md)"
        )
    torch.ops.load_library(str(_LIBRARY_PATH))
