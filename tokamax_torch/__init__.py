"""tokamax_torch: high-performance kernels as native PyTorch operators (``torch.ops.tokamax``).

Each op family has two singletons with one signature: ``tokamax_torch.ops.<op>.reference``
(plain ATen ops, the ground truth) and ``tokamax_torch.ops.<op>.kernel`` (the hand-written
kernel); ``tokamax_torch.<op>`` is the kernel.
"""

from tokamax_torch import _library

_library.load()

import torch  # noqa: E402

from tokamax_torch import ops  # noqa: E402

__version__ = "0.1.0"

ragged_dot = ops.ragged_dot.kernel


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


def get_configs(op, *args, from_autotuning_cache: bool = False, **kwargs):
    """The (fwd_config, bwd_config) ``op`` would use for these arguments.

    ``from_autotuning_cache=False``: the heuristic configs, exactly what the op picks when
    called with ``configs=None`` (for ragged_dot, bwd is a BackwardConfig holding the configs of
    the lhs- and rhs-gradient products). ``True``: the autotuning cache is not built yet, so this falls
    back to the heuristics. The reference returns ``(None, None)``. Works on meta tensors.
    """
    del from_autotuning_cache  # The on-disk cache lands with the autotuning issue.
    return op.get_configs(*args, **kwargs)


__all__ = ["device_kind", "get_configs", "ops", "ragged_dot"]
