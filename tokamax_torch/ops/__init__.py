"""One module per op family, each with ``reference``, ``kernel`` and ``Config``.

Every module of this folder whose name does not start with ``_`` is imported here; making its
singletons registers the op (``tokamax_torch._registry``), so a new op is one new module and no
list to edit.
"""

import importlib
import pkgutil

from tokamax_torch import _registry

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = list(_registry.families())
