"""Property tests: each op's kernel on random problems against its float64 oracle.

Every op family in the registry declares its hypothesis tests in ``PROPERTIES`` in its test file,
``tests/test_<family>.py`` (shared strategies and the profile in ``tests/strategies.py``); they run
here, under their names with ``test_`` in front. A family without properties fails, so adding an
op edits no list.
"""

import importlib

import pytest

from tokamax_torch import _registry

MODULES = {name: importlib.import_module(f"test_{name}") for name in sorted(_registry.families())}

for _name, _module in MODULES.items():
    for _property in getattr(_module, "PROPERTIES", ()):
        assert not _property.__name__.startswith("test_"), (
            f"test_{_name}.PROPERTIES: {_property.__name__} would also run in its own file; drop the test_ prefix")
        globals()[f"test_{_property.__name__}"] = _property


@pytest.mark.parametrize("name", list(MODULES))
def test_every_op_family_declares_properties(name):
    assert getattr(MODULES[name], "PROPERTIES", ()), f"tests/test_{name}.py declares no PROPERTIES"
