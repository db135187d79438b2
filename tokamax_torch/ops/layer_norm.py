"""layer_norm and rms_norm over the last axis, with Gemma's ``scale_offset`` and the fused
pre-norm residual add.

``y = (h - mean(h)) * rstd * (scale + scale_offset) + offset`` with ``rstd = 1/sqrt(var(h) +
epsilon)`` and ``h = x`` (or ``x + residual``, added in fp32 and stored in x's dtype);
``rms_norm`` is the same with ``subtract_mean=False`` (mean taken as 0). Statistics and
arithmetic in fp32 (float64 for float64), outputs in x's dtype. The semantics are Tokamax's
``layer_norm``. The math, checks and autograd live in C++ (``csrc/torch/layer_norm.cc``).
"""

from __future__ import annotations

from typing import Optional

import torch

from tokamax_torch import _op
from tokamax_torch import configs as _configs

#: Blocking of the CPU kernel; its fields come from ``tokamax::LayerNormConfig``'s field list.
Config = _configs.config_class("layer_norm", __name__, "Blocking of the layer_norm CPU kernel.")
#: The forward call and its backward, as declared in C++ (TOKAMAX_LAYER_NORM_PRODUCTS).
PRODUCTS = _configs.products("layer_norm")


def _float(value, name: str) -> Optional[float]:
    return _op.scalar_float("layer_norm", name, value, optional=True)


class _LayerNorm(_op.Op):
    """A layer_norm implementation; ``reference`` and ``kernel`` share this signature."""

    family = "layer_norm"
    product_specs = _op.declared_products(PRODUCTS, wrt={"backward": ("x",)})
    config_cls = Config
    summary = (
        "LayerNorm / RMSNorm (`rms_norm`, `subtract_mean=False`) over the last axis with Gemma's `scale_offset` "
        "and the fused pre-norm residual add; fp32 statistics, batch-invariant rows, fixed-order dscale/doffset "
        "sums. CPU kernel with `scalar`, `avx2` and `avx512` tiers. `torch.compile` (fullgraph, dynamic shapes) "
        "and `torch.export`.")
    cli_shape = "R,D"

    def __call__(
        self,
        x: torch.Tensor,
        scale: Optional[torch.Tensor] = None,
        offset: Optional[torch.Tensor] = None,
        *,
        axis: int = -1,
        epsilon: Optional[float] = None,
        scale_offset: Optional[float] = None,
        subtract_mean: bool = True,
        residual: Optional[torch.Tensor] = None,
        return_residuals: bool = False,
        configs=None,
    ):
        """epsilon=None means 1e-6, scale_offset=None means 0.0 (None keeps torch.compile from
        tracing them as symbolic floats). Returns y; ``(y, h)`` with a residual; and with
        ``return_residuals=True`` ``(that, (mean, rstd))``, both fp32 (float64 for float64 x) of
        x's leading shape (mean is zeros when subtract_mean=False)."""
        fwd, bwd = self._split_configs(configs)
        y, h, mean, rstd = self._op(x, scale, offset, residual, _op.scalar_int(self.family, "axis", axis),
                                    _float(epsilon, "epsilon"), _float(scale_offset, "scale_offset"),
                                    _op.scalar_flag(self.family, "subtract_mean", subtract_mean),
                                    _configs.config_to_list(fwd), _configs.config_to_list(bwd))
        out = (y, h) if residual is not None else y
        return (out, (mean, rstd)) if _op.scalar_flag(self.family, "return_residuals", return_residuals) else out

    def canonicalize(self, arguments: dict) -> dict:
        arguments["axis"] = _op.scalar_int(self.family, "axis", arguments["axis"])
        arguments["epsilon"] = _float(arguments["epsilon"], "epsilon")
        arguments["scale_offset"] = _float(arguments["scale_offset"], "scale_offset")
        return arguments

    def config_op_arguments(self, bound) -> tuple:
        return bound["x"], bound["axis"]

    def add_cli_arguments(self, parser) -> None:
        parser.add_argument("--residual", action="store_true", help="with the fused residual add")
        parser.add_argument("--rms", action="store_true", help="subtract_mean=False (rms_norm)")

    def cli_call(self, shape: str, dtype: torch.dtype, options):
        try:
            rows, cols = (int(v) for v in shape.split(","))
        except ValueError:
            raise ValueError(f"--shape must be R,D (rows, normalised length: two ints), got {shape!r}") from None
        meta = dict(device="meta")
        x = torch.empty(rows, cols, dtype=dtype, **meta)
        return self.bind(x, torch.empty(cols, **meta), None if options.rms else torch.empty(cols, **meta),
                         subtract_mean=not options.rms,
                         residual=torch.empty(rows, cols, dtype=dtype, **meta) if options.residual else None)

    def cache_key_arguments(self, bound) -> dict:
        """The sizes, dtype and the residual's presence choose the config; the options do not."""
        return {"x": bound["x"], "residual": bound["residual"]}


class _RmsNorm:
    """``rms_norm``: the layer_norm singleton ``impl`` with ``subtract_mean=False``."""

    def __init__(self, impl: _LayerNorm) -> None:
        self.impl = impl

    def __call__(self, x, scale=None, offset=None, *, axis=-1, epsilon=None, scale_offset=None, residual=None,
                 return_residuals=False, configs=None):
        return self.impl(x, scale, offset, axis=axis, epsilon=epsilon, scale_offset=scale_offset, subtract_mean=False,
                         residual=residual, return_residuals=return_residuals, configs=configs)

    def __repr__(self) -> str:
        return f"tokamax_torch.ops.layer_norm.rms_norm ({self.impl!r} with subtract_mean=False)"


reference = _LayerNorm("reference", torch.ops.tokamax.layer_norm_reference.default)
kernel = _LayerNorm("kernel", torch.ops.tokamax.layer_norm.default)
#: ``tokamax_torch.rms_norm``: layer_norm's kernel with ``subtract_mean=False``.
rms_norm = _RmsNorm(kernel)
rms_norm_reference = _RmsNorm(reference)

__all__ = ["Config", "kernel", "reference", "rms_norm", "rms_norm_reference"]
