"""gated_linear_unit: ``activation(x @ w_gate) * (x @ w_up)`` over the last axis of x
``[..., M, K]``, with weights fused ``[K, 2, N]`` (gate, up) or a pair of ``[K, N]``.

Activations: ``"swish"`` (SwiGLU; alias ``"silu"``), ``"gelu"`` (tanh approximation),
``"gelu_exact"`` (GeGLU), ``"relu"`` (ReGLU), ``"sigmoid"`` (GLU), ``None`` (bilinear). The
kernel is one gated GEMM: both products share one packed pass over x and the activation and
product run in the GEMM's store, so the forward never materialises the ``[M, 2N]``
pre-activations unless they are needed for a backward. The math, checks and autograd live in
C++ (``csrc/torch/gated_linear_unit.cc``).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from tokamax_torch import _op
from tokamax_torch import configs as _configs

#: Blocking of the CPU kernel; its fields come from ``tokamax::GatedLinearUnitConfig``'s field list.
Config = _configs.config_class("gated_linear_unit", __name__, "Blocking of the gated_linear_unit CPU kernel.")
#: The forward call and its backward, as declared in C++ (TOKAMAX_GATED_LINEAR_UNIT_PRODUCTS).
PRODUCTS = _configs.products("gated_linear_unit")

Weights = Union[torch.Tensor, tuple]


def _split_weights(weights):
    """(gate or fused, up or None)."""
    if isinstance(weights, (tuple, list)):
        if len(weights) != 2:
            raise TypeError(f"gated_linear_unit: weights must be one fused [K, 2, N] tensor or a pair of [K, N] "
                            f"tensors, got a sequence of {len(weights)}")
        return weights[0], weights[1]
    return weights, None


def _activation(activation) -> str:
    if activation is None:
        return "none"
    if not isinstance(activation, str):
        raise TypeError(f"gated_linear_unit: activation must be a name (swish, gelu, gelu_exact, relu, sigmoid) or "
                        f"None, got {type(activation).__name__}")
    return activation


class _GatedLinearUnit(_op.Op):
    """A gated_linear_unit implementation; ``reference`` and ``kernel`` share this signature."""

    family = "gated_linear_unit"
    product_specs = _op.declared_products(PRODUCTS, wrt={"backward": ("x", "weights")})
    config_cls = Config
    summary = (
        "Gated linear unit `act(x @ w_gate) * (x @ w_up)` (SwiGLU, GeGLU, ReGLU, GLU, bilinear), weights fused "
        "`[K, 2, N]` or a pair; one gated GEMM (one packed pass over x, activation and product in the store, no "
        "`[M, 2N]` in inference), backward on the GEMM core from the saved pre-activations. CPU kernel with "
        "`scalar`, `avx2`, `avx512` tiers and bf16 on the AVX512-BF16 / AMX engines. `torch.compile` and "
        "`torch.export`.")
    cli_shape = "M,K,N"

    def __call__(self, x: torch.Tensor, weights: Weights, *, activation: Optional[str] = "swish",
                 return_residuals: bool = False, configs=None):
        """Returns out ``[..., M, N]`` in x's dtype; with ``return_residuals=True`` ``(out,
        residuals)``, residuals the pre-activations ``[..., M, 2, N]`` (gate, up) in x's dtype."""
        fwd, bwd = self._split_configs(configs)
        gate, up = _split_weights(weights)
        return_residuals = _op.scalar_flag(self.family, "return_residuals", return_residuals)
        out, residuals = self._op(x, gate, up, _activation(activation), return_residuals,
                                  _configs.config_to_list(fwd), _configs.config_to_list(bwd))
        return (out, residuals) if return_residuals else out

    def canonicalize(self, arguments: dict) -> dict:
        arguments["activation"] = _activation(arguments["activation"])
        if isinstance(arguments["weights"], list):
            arguments["weights"] = tuple(arguments["weights"])
        return arguments

    def config_op_arguments(self, bound) -> tuple:
        gate, up = _split_weights(bound["weights"])
        return (bound["x"], gate, up)

    def cache_key_arguments(self, bound) -> dict:
        """Sizes, dtype and whether the weights' columns are contiguous (a few-row forward reads
        them in place, with its own blocking) choose the config; the activation and the fused or
        paired form do not."""
        gate, up = _split_weights(bound["weights"])
        return {"x": bound["x"], "k": gate.shape[0], "n": gate.shape[-1],
                "weights_in_place": _op.columns_contiguous(gate, up)}

    def real_argument(self, bound, name, value, generator):
        """A pair of weights becomes one fused tensor: the same kernels run, and the autotuner can
        differentiate it as one input."""
        if name == "weights" and isinstance(value, tuple):
            fused = torch.stack([super(_GatedLinearUnit, self).real_argument(bound, name, w, generator)
                                 for w in value], dim=1)
            if _op.columns_contiguous(*value):
                return fused
            # Columns strided like the pair's (nn.Linear's transposed views): the layout the
            # blocking was chosen for.
            k, _, n = fused.shape
            return fused.reshape(k, 2 * n).t().contiguous().t().view(k, 2, n)
        return super().real_argument(bound, name, value, generator)

    def cli_call(self, shape: str, dtype: torch.dtype, options):
        try:
            m, k, n = (int(v) for v in shape.split(","))
        except ValueError:
            raise ValueError(f"--shape must be M,K,N (three ints), got {shape!r}") from None
        meta = dict(device="meta", dtype=dtype)
        return self.bind(torch.empty(m, k, **meta), torch.empty(k, 2, n, **meta))


reference = _GatedLinearUnit("reference", torch.ops.tokamax.gated_linear_unit_reference.default)
kernel = _GatedLinearUnit("kernel", torch.ops.tokamax.gated_linear_unit.default)

__all__ = ["Config", "kernel", "reference"]
