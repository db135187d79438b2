"""fused_moe: a mixture-of-experts feed-forward from router logits (Tokamax's fused_moe).

``fused_moe(x[T, H], w1[E, H, 2I], w2[E, I, H], gating[T, E], *, topk, renormalize=True,
act_fn="silu", w1_bias=None, w2_bias=None) -> [T, H]``: ``p = softmax(gating[t])`` in fp32, the
``topk`` largest p (ties to the lowest expert id) as the routing weights, divided by their sum when
``renormalize``, then ``fused_experts`` with those weights and ids. Differentiable in x, w1, w2,
the biases and gating (through the softmax and the renormalisation; the selection itself is
piecewise constant). The math, checks and autograd live in C++ (``csrc/torch/fused_moe.cc``,
``csrc/ops/fused_moe/``).
"""

from __future__ import annotations

from typing import Optional

import torch

from tokamax_torch import _op
from tokamax_torch import configs as _configs
from tokamax_torch.ops.fused_experts import _experts_cache_key, _hf_weights, _parse_shape, _weight_argument

#: Blocking of the CPU kernel; its fields come from ``tokamax::FusedMoeConfig``'s field list.
Config = _configs.config_class("fused_moe", __name__, "Blocking of the fused_moe CPU kernel.")
#: The forward call and its backward, as declared in C++ (TOKAMAX_FUSED_MOE_PRODUCTS).
PRODUCTS = _configs.products("fused_moe")


class _FusedMoe(_op.Op):
    """A fused_moe implementation; ``reference`` and ``kernel`` share this signature."""

    family = "fused_moe"
    product_specs = _op.declared_products(
        PRODUCTS, wrt={"backward": ("x", "w1", "w2", "gating")})
    config_cls = Config
    cli_shape = "T,H,I,E,k"
    summary = ("MoE feed-forward from router logits: softmax, top-k (ties to the lowest id), optional "
               "renormalisation, then `fused_experts`; backward into x, weights, biases and gating.")

    def __call__(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gating: torch.Tensor, *, topk: int,
                 renormalize: bool = True, act_fn: str = "silu", w1_bias: Optional[torch.Tensor] = None,
                 w2_bias: Optional[torch.Tensor] = None, configs=None) -> torch.Tensor:
        fwd, bwd = self._split_configs(configs)
        return self._op(x, w1, w2, gating, _op.scalar_int(self.family, "topk", topk),
                        _op.scalar_flag(self.family, "renormalize", renormalize), str(act_fn), w1_bias, w2_bias,
                        _configs.config_to_list(fwd), _configs.config_to_list(bwd))

    def canonicalize(self, arguments: dict) -> dict:
        arguments["renormalize"] = _op.scalar_flag(self.family, "renormalize", arguments["renormalize"])
        return arguments

    def config_op_arguments(self, bound) -> tuple:
        return bound["x"], bound["w1"], bound["w2"], bound["gating"], int(bound["topk"])

    def cli_call(self, shape: str, dtype: torch.dtype, options):
        t, h, i, e, k = _parse_shape(shape)
        w1, w2 = _hf_weights(e, h, i, dtype)
        return self.bind(torch.empty(t, h, device="meta", dtype=dtype), w1, w2,
                         torch.empty(t, e, device="meta", dtype=dtype), topk=k)

    def real_argument(self, bound, name, value, generator):
        """w1, w2 keep the meta tensor's layout."""
        if name in ("w1", "w2") and isinstance(value, torch.Tensor) and value.device.type == "meta":
            return _weight_argument(value, generator)
        return super().real_argument(bound, name, value, generator)

    def cache_key_arguments(self, bound) -> dict:
        """Sizes, dtype, topk and whether the weights' columns are contiguous (a decode task reads
        them in place, with its own blocking) choose the config; act_fn, renormalize and the
        biases cost the same."""
        return _experts_cache_key(bound, ("x", "w1", "w2", "gating", "topk"))


reference = _FusedMoe("reference", torch.ops.tokamax.fused_moe_reference.default)
kernel = _FusedMoe("kernel", torch.ops.tokamax.fused_moe.default)

__all__ = ["Config", "kernel", "reference"]
