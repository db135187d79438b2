"""tokamax_torch: high-performance kernels as native PyTorch operators (``torch.ops.tokamax``).

Each op family has two singletons with one signature: ``tokamax_torch.ops.<op>.reference``
(plain ATen ops, the ground truth) and ``tokamax_torch.ops.<op>.kernel`` (the hand-written
kernel); ``tokamax_torch.<op>`` is the kernel.
"""

from tokamax_torch import _library

_library.load()

import torch  # noqa: E402

import sys as _sys  # noqa: E402
import types as _types  # noqa: E402

from tokamax_torch import _registry, ops  # noqa: E402
from tokamax_torch._op import BoundArguments  # noqa: E402
from tokamax_torch._settings import config  # noqa: E402
from tokamax_torch.autotuning import AutotuningResult, autotune, lookup_configs  # noqa: E402
from tokamax_torch.autotuning.autotuner import bind_call  # noqa: E402

__version__ = "0.1.0"

# tokamax_torch.<op> is the kernel singleton of every registered op family.
for _family in _registry.families().values():
    globals()[_family.name] = _family.kernel
del _family
#: layer_norm's kernel with subtract_mean=False (tokamax_torch.ops.layer_norm.rms_norm).
rms_norm = ops.layer_norm.rms_norm


def device_kind(device=None) -> str:
    """The hardware generation kernels and autotuning caches are keyed by.

    CPU: ``<vendor>_<microarchitecture>_<isa tier>``, e.g. ``amd_zen3_avx2``; the tier is the
    one kernels use now (``TOKAMAX_CPU_ISA`` can lower it).
    """
    device = torch.device("cpu" if device is None else device)
    if device.type != "cpu":
        raise NotImplementedError(f"device_kind: only CPU devices are supported so far, got {device}")
    vendor, microarchitecture, isa = torch.ops.tokamax._cpu_description()[:3]
    return f"{vendor}_{microarchitecture}_{isa}"


def empty_cache() -> None:
    """Returns the kernels' cached working memory to the operating system.

    The kernels keep two kinds of memory after a call, so the next call reuses it: large
    buffers (per-call packed K/V copies and partial sums, and the memory of the ops' freed output
    tensors over 1 MiB; already-mapped pages instead of fresh zeroed ones) and each thread's
    scratch (packed GEMM panels, attention's tile buffers). Both together are held up to
    ``cache_limit()`` bytes (``TOKAMAX_BUFFER_CACHE_MIB``; default 1/8 of memory, clamped to
    256 MiB..4 GiB; 0 keeps none). This frees all of it; scratch in use by a kernel running on
    another thread at that moment is freed when that kernel's task ends; live tensors are never
    touched. ``cached_bytes()`` says how much is held.
    """
    torch.ops.tokamax._empty_buffer_cache()


def cached_bytes() -> int:
    """Bytes of working memory the kernels hold for reuse: the large-buffer cache plus every
    thread's idle scratch (see ``empty_cache``); 0 right after ``empty_cache()``."""
    return int(torch.ops.tokamax._buffer_cache_bytes())


def cache_limit() -> int:
    """The most bytes ``cached_bytes()`` may reach (see ``empty_cache``)."""
    return int(torch.ops.tokamax._buffer_cache_limit())


def set_cache_limit(nbytes: int) -> None:
    """Sets ``cache_limit()`` for this process (as ``TOKAMAX_BUFFER_CACHE_MIB`` does at start),
    freeing what no longer fits. 0 turns the cache off: from then on large outputs come from
    torch's allocator and every buffer is returned to the system when freed."""
    torch.ops.tokamax._set_buffer_cache_limit(int(nbytes))


def get_configs(op, *args, from_autotuning_cache: bool = False, **kwargs):
    """The (fwd_config, bwd_config) to pass back to ``op`` as ``configs=``.

    ``from_autotuning_cache=False``: the heuristic configs, exactly what the op picks when
    called with ``configs=None`` (for ragged_dot, bwd is a BackwardConfig holding the configs of
    the lhs- and rhs-gradient products). ``True``: exact-key lookups in the autotuning cache for
    this device kind (user directory over shipped data), each product falling back to its
    heuristic on a miss; ``tokamax_torch.config.autotuning_cache_miss`` can make a miss warn or
    raise. The reference returns ``(None, None)``. Works on meta tensors. ``op`` may also be a
    ``BoundArguments`` (``op.bind(*args, **kwargs)``), with no further arguments.
    """
    bound = bind_call(op, args, kwargs)
    if from_autotuning_cache:
        return lookup_configs(bound)
    return bound.heuristic_configs()


class _Package(_types.ModuleType):
    """This package's module type. Importing a submodule binds it as an attribute of the package;
    here that never replaces a public name that is not a module: ``tokamax_torch.autotune`` is
    the function even after ``import tokamax_torch.autotune`` (the command line's module)."""

    def __setattr__(self, name: str, value) -> None:
        current = self.__dict__.get(name)
        if isinstance(value, _types.ModuleType) and current is not None and not isinstance(current, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package

__all__ = sorted([
    "AutotuningResult",
    "BoundArguments",
    "autotune",
    "cache_limit",
    "cached_bytes",
    "config",
    "device_kind",
    "empty_cache",
    "get_configs",
    "ops",
    "rms_norm",
    "set_cache_limit",
    *_registry.families(),
])
