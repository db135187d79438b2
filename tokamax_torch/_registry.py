"""The op registry: every op family's singletons, registered as they are made.

An op module under ``tokamax_torch/ops/`` creates its ``reference`` and ``kernel`` singletons
(``tokamax_torch._op.Op``); creating one registers it here. ``tokamax_torch.ops`` imports every
module of its folder, so adding an op edits no central list: the package's names, the
autotuning command line and the README's op table (``op_table()``) read the registry.
"""

from __future__ import annotations

import dataclasses

#: The singletons every op family has, in the order the docs name them.
SINGLETONS = ("reference", "kernel")


@dataclasses.dataclass
class OpFamily:
    name: str
    singletons: dict = dataclasses.field(default_factory=dict)

    @property
    def kernel(self):
        return self.singletons["kernel"]

    @property
    def reference(self):
        return self.singletons["reference"]

    @property
    def complete(self) -> bool:
        return all(name in self.singletons for name in SINGLETONS)


_FAMILIES: dict[str, OpFamily] = {}


def register(singleton) -> None:
    """Adds `singleton` (an ``Op``) under its family and name; a second one of the same family
    and name is an error (two modules claiming one op)."""
    family = _FAMILIES.setdefault(singleton.family, OpFamily(singleton.family))
    existing = family.singletons.get(singleton.name)
    if existing is not None:
        raise ValueError(f"tokamax_torch: op {singleton.family!r} already has a {singleton.name} singleton "
                         f"({existing!r} of {type(existing).__module__})")
    family.singletons[singleton.name] = singleton


def families() -> dict[str, OpFamily]:
    """Every complete op family (both singletons made), by name, sorted."""
    return {name: _FAMILIES[name] for name in sorted(_FAMILIES) if _FAMILIES[name].complete}


def family(name: str) -> OpFamily:
    """The op family called `name`; KeyError listing the known ones."""
    known = families()
    if name not in known:
        raise KeyError(f"tokamax_torch: no op family {name!r}; known: {list(known)}")
    return known[name]


def tunable_families() -> dict[str, OpFamily]:
    """The families whose kernel has configs to autotune."""
    return {name: f for name, f in families().items() if f.kernel.tunable}


def op_table() -> str:
    """The README's op table (markdown), one row per registered op family."""
    rows = ["| Op | Autotuned products | Status |", "| --- | --- | --- |"]
    for name, f in families().items():
        products = ", ".join(f"`{p}`" for p in f.kernel.products) if f.kernel.tunable else "none"
        summary = " ".join(f.kernel.summary.split()) or "(no summary)"
        rows.append(f"| `{name}` | {products} | {summary} |")
    return "\n".join(rows) + "\n"
