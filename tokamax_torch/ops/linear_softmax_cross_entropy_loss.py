"""linear_softmax_cross_entropy_loss: the cross-entropy of ``softmax(x @ weights)`` against
integer labels, fused so the ``[B, V]`` logits never exist, forward or backward.

``x[B, H]``, ``labels[B]`` (int64/int32), ``weights[H, V]`` (the transposed view of an
``nn.Linear`` weight works without a copy). Per row, with ``z = x @ weights`` (``cap·tanh(z/cap)``
with ``logits_soft_cap``): ``loss = (1-ε)(lse - z[label]) + ε(lse - mean(z)) +
z_loss_weight·lse²``, 0 for rows whose label is ``ignore_index``; ``sum``, ``mean`` (over the
non-ignored rows, 0 when there are none) or ``none``. Loss and lse are fp32 (float64 for
float64). The math, checks and autograd live in C++ (``csrc/torch/linear_softmax_cross_entropy_loss.cc``).
"""

from __future__ import annotations

from typing import Optional

import torch

from tokamax_torch import _op
from tokamax_torch import configs as _configs

#: Tiling of the CPU kernel; its fields come from ``tokamax::LinearCrossEntropyConfig``'s field list.
Config = _configs.config_class("linear_softmax_cross_entropy_loss", __name__,
                               "Tiling of the linear_softmax_cross_entropy_loss CPU kernel.")
#: The forward call and its backward, as declared in C++.
PRODUCTS = _configs.products("linear_softmax_cross_entropy_loss")


def _float(value, name: str) -> Optional[float]:
    return _op.scalar_float("linear_softmax_cross_entropy_loss", name, value, optional=True)


class _LinearSoftmaxCrossEntropyLoss(_op.Op):
    """A linear_softmax_cross_entropy_loss implementation; ``reference`` and ``kernel`` share this signature."""

    family = "linear_softmax_cross_entropy_loss"
    product_specs = _op.declared_products(PRODUCTS, wrt={"backward": ("x", "weights")})
    config_cls = Config
    summary = (
        "Fused `x @ weights` + softmax cross-entropy (LM head loss) that never materialises the [B, V] logits: "
        "vocabulary tiles on the GEMM core (bf16 engine / AMX for bf16), online logsumexp, backward recomputing "
        "each tile into dx and dweights; sum/mean/none, ignore_index, label smoothing, z-loss, logits soft cap. "
        "`torch.compile` (fullgraph, dynamic shapes) and `torch.export`.")
    cli_shape = "B,H,V"

    def __call__(
        self,
        x: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        *,
        reduction: str = "sum",
        ignore_index: int = -100,
        label_smoothing: Optional[float] = None,
        z_loss_weight: Optional[float] = None,
        logits_soft_cap: Optional[float] = None,
        return_residuals: bool = False,
        configs=None,
    ):
        """label_smoothing / z_loss_weight None mean 0.0, logits_soft_cap None means no cap (None
        keeps torch.compile from tracing them as symbolic floats). Returns the loss (a scalar for
        sum/mean, [B] for none); with ``return_residuals=True`` ``(loss, lse)``, lse [B]."""
        fwd, bwd = self._split_configs(configs)
        loss, lse = self._op(x, labels, weights, str(reduction), _op.scalar_int(self.family, "ignore_index", ignore_index),
                             _float(label_smoothing, "label_smoothing"), _float(z_loss_weight, "z_loss_weight"),
                             _float(logits_soft_cap, "logits_soft_cap"), _configs.config_to_list(fwd),
                             _configs.config_to_list(bwd))
        return (loss, lse) if _op.scalar_flag(self.family, "return_residuals", return_residuals) else loss

    def canonicalize(self, arguments: dict) -> dict:
        arguments["reduction"] = str(arguments["reduction"])
        arguments["ignore_index"] = _op.scalar_int(self.family, "ignore_index", arguments["ignore_index"])
        for name in ("label_smoothing", "z_loss_weight", "logits_soft_cap"):
            arguments[name] = _float(arguments[name], name)
        return arguments

    def config_op_arguments(self, bound) -> tuple:
        return bound["x"], bound["labels"], bound["weights"]

    def cli_call(self, shape: str, dtype: torch.dtype, options):
        try:
            batch, hidden, vocab = (int(v) for v in shape.split(","))
        except ValueError:
            raise ValueError(f"--shape must be B,H,V (rows, hidden, vocabulary: three ints), got {shape!r}") from None
        meta = dict(device="meta")
        return self.bind(torch.empty(batch, hidden, dtype=dtype, **meta),
                         torch.empty(batch, dtype=torch.long, **meta),
                         torch.empty(hidden, vocab, dtype=dtype, **meta))

    def cache_key_arguments(self, bound) -> dict:
        """The sizes and dtype choose the config; the options do not."""
        return {"x": bound["x"], "weights": bound["weights"]}


reference = _LinearSoftmaxCrossEntropyLoss("reference", torch.ops.tokamax.linear_softmax_cross_entropy_loss_reference.default)
kernel = _LinearSoftmaxCrossEntropyLoss("kernel", torch.ops.tokamax.linear_softmax_cross_entropy_loss.default)

__all__ = ["Config", "kernel", "reference"]
