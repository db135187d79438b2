"""fused_experts: a mixture-of-experts feed-forward with the routing already decided.

``fused_experts(x[T, H], w1[E, H, 2I], w2[E, I, H], topk_weights[T, k], topk_ids[T, k], *,
act_fn="silu", w1_bias=None, w2_bias=None) -> [T, H]``: token t's output is the sum over its k
slots, ascending, in fp32 (float64 for float64), of ``topk_weights[t, j] * expert(x[t])`` for
expert ``e = topk_ids[t, j]``, with ``expert(v) = (act(v·w1[e][:, :I] + b1[e][:I]) * (v·w1[e][:, I:] +
b1[e][I:]))·w2[e] + b2[e]`` (gate = the first I columns, up = the last I), stored in x's dtype.
``act_fn`` is ``"silu"`` or ``"gelu"`` (the tanh approximation, as ``jax.nn.gelu``). The weights
may be transposed views (Hugging Face's ``gate_up_proj[E, 2I, H].transpose(1, 2)`` and
``down_proj[E, H, I].transpose(1, 2)``): they are read in place. Differentiable in x, w1, w2, the
biases and topk_weights. This is what Hugging Face's experts interface hands a backend. The math,
checks and autograd live in C++ (``csrc/torch/fused_moe.cc``, ``csrc/ops/fused_moe/``).
"""

from __future__ import annotations

from typing import Optional

import torch

from tokamax_torch import _op
from tokamax_torch import configs as _configs

#: Blocking of the CPU kernel; its fields come from ``tokamax::FusedExpertsConfig``'s field list.
Config = _configs.config_class("fused_experts", __name__, "Blocking of the fused_experts CPU kernel.")
#: The forward call and its backward, as declared in C++ (TOKAMAX_FUSED_MOE_PRODUCTS).
PRODUCTS = _configs.products("fused_experts")


def _weight_argument(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A real weight with the meta tensor's strides (the kernel's speed depends on the layout)."""
    out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    return out.copy_(torch.randn(value.shape, generator=generator))


def _experts_cache_key(bound, names) -> dict:
    """The named arguments, and whether w1's and w2's columns are contiguous (a decode task then
    reads them in place, with its own blocking): fused_experts' and fused_moe's cache keys."""
    key = {name: bound[name] for name in names}
    key["weights_in_place"] = _op.columns_contiguous(bound["w1"], bound["w2"])
    return key


def _hf_weights(experts: int, hidden: int, inter: int, dtype: torch.dtype):
    """Meta w1, w2 as Hugging Face stores them (gate_up_proj, down_proj), transposed views."""
    meta = dict(device="meta", dtype=dtype)
    return (torch.empty(experts, 2 * inter, hidden, **meta).transpose(1, 2),
            torch.empty(experts, hidden, inter, **meta).transpose(1, 2))


def _parse_shape(shape: str) -> tuple[int, ...]:
    try:
        t, h, i, e, k = (int(v) for v in shape.split(","))
    except ValueError:
        raise ValueError(f"--shape must be T,H,I,E,k (five ints), got {shape!r}") from None
    return t, h, i, e, k


class _FusedExperts(_op.Op):
    """A fused_experts implementation; ``reference`` and ``kernel`` share this signature."""

    family = "fused_experts"
    product_specs = _op.declared_products(
        PRODUCTS, wrt={"backward": ("x", "w1", "w2", "topk_weights")})
    config_cls = Config
    cli_shape = "T,H,I,E,k"
    summary = ("MoE experts with routing given (Hugging Face's experts interface): gate-and-up GEMM, GLU (silu / "
               "gelu-tanh), down GEMM, fp32 weighted combine, with its backward (into the routing weights too); "
               "weights as transposed views without copies.")

    def __call__(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *, act_fn: str = "silu", w1_bias: Optional[torch.Tensor] = None,
                 w2_bias: Optional[torch.Tensor] = None, configs=None) -> torch.Tensor:
        fwd, bwd = self._split_configs(configs)
        return self._op(x, w1, w2, topk_weights, topk_ids, str(act_fn), w1_bias, w2_bias,
                        _configs.config_to_list(fwd), _configs.config_to_list(bwd))

    def config_op_arguments(self, bound) -> tuple:
        return bound["x"], bound["w1"], bound["w2"], bound["topk_ids"]

    def cli_call(self, shape: str, dtype: torch.dtype, options):
        t, h, i, e, k = _parse_shape(shape)
        w1, w2 = _hf_weights(e, h, i, dtype)
        return self.bind(torch.empty(t, h, device="meta", dtype=dtype), w1, w2,
                         torch.empty(t, k, device="meta"), torch.empty(t, k, device="meta", dtype=torch.int64))

    def real_argument(self, bound, name, value, generator):
        """topk_ids: k distinct random experts per token (zeros would send every token to one);
        w1, w2: the meta tensor's layout."""
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            if name == "topk_ids":
                t, k = value.shape
                experts = bound["w1"].shape[0]
                return torch.rand(t, experts, generator=generator).argsort(1)[:, :k].to(value.dtype)
            if name in ("w1", "w2"):
                return _weight_argument(value, generator)
        return super().real_argument(bound, name, value, generator)

    def cache_key_arguments(self, bound) -> dict:
        """Sizes, dtype and whether the weights' columns are contiguous (a decode task reads them in
        place, with its own blocking) choose the config; act_fn and the biases cost the same."""
        return _experts_cache_key(bound, ("x", "w1", "w2", "topk_ids"))


reference = _FusedExperts("reference", torch.ops.tokamax.fused_experts_reference.default)
kernel = _FusedExperts("kernel", torch.ops.tokamax.fused_experts.default)

__all__ = ["Config", "kernel", "reference"]
