"""dot_product_attention: multi-head attention with grouped kv heads, masks and soft-capping.

``query[B,T,N,H]``, ``key[B,S,K,H]``, ``value[B,S,K,Hv]`` -> ``out[B,T,N,Hv]`` (and, with
``return_residuals=True``, the logsumexp ``[B,N,T]`` in float32). Query head ``n`` reads kv head
``n // (N // K)``. ``logits = scale * q·kᵀ + bias``, then ``cap * tanh(logits / cap)`` when
``logits_soft_cap`` is set, then the masks, a float32 softmax and ``· value``. A query that sees
no key gets zeros (and zero gradients), never NaN. Layout and names follow Tokamax. The math,
checks and autograd live in C++ (``csrc/torch/dot_product_attention.cc``); this module only
turns Python arguments into the schema's primitives.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from tokamax_torch import configs as _configs


#: Tiling of the CPU kernel; its fields come from ``tokamax::DotProductAttentionConfig``'s field list.
Config = _configs.config_class(
    "dot_product_attention",
    __name__,
    "Tiling of the dot_product_attention CPU kernel (``tokamax::DotProductAttentionConfig``); one Config "
    "serves the forward and the backward.",
)

#: The forward call and its backward, as declared in C++ (TOKAMAX_DOT_PRODUCT_ATTENTION_PRODUCTS).
PRODUCTS = _configs.products("dot_product_attention")
ConfigLike = Union[Config, Sequence[int], None]
WindowLike = Union[int, Sequence[Optional[int]], None]
#: What an unbounded side of the window crosses the schema as (the kernel clamps it).
_UNBOUNDED = 1 << 62


def _window(local_window_size: WindowLike) -> Optional[list[int]]:
    """``w`` means ``(w, w)``; a ``None`` side is unbounded."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, int) and not isinstance(local_window_size, bool):
        return [local_window_size, local_window_size]
    if isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
        sides = []
        for side in local_window_size:
            if side is None:
                sides.append(_UNBOUNDED)
            elif isinstance(side, int) and not isinstance(side, bool):
                sides.append(side)
            else:
                break
        else:
            return sides
    raise TypeError(
        "dot_product_attention: local_window_size must be an int w (meaning (w, w)), a (left, right) "
        f"pair of ints or None, or None; got {local_window_size!r}"
    )


def _optional_float(value, name: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"dot_product_attention: {name} must be a number or None, got {value!r}")
    return float(value)


def _block_sparse(is_causal, local_window_size, query_seq_lengths, key_value_seq_lengths, q_segment_ids) -> bool:
    """Whether some mask lets the kernel skip whole kv tiles (the heuristics tile finer then)."""
    return bool(is_causal) or local_window_size is not None or query_seq_lengths is not None or (
        key_value_seq_lengths is not None) or q_segment_ids is not None


class _DotProductAttention(_configs.OpSingleton):
    """A dot_product_attention implementation; ``reference`` and ``kernel`` share this signature."""

    family = "dot_product_attention"
    #: Products an autotuner tunes separately: the forward call and its backward.
    product_ids = PRODUCTS
    config_cls = Config

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        mask: Optional[torch.Tensor] = None,
        *,
        scale: Optional[float] = None,
        is_causal: bool = False,
        query_seq_lengths: Optional[torch.Tensor] = None,
        key_value_seq_lengths: Optional[torch.Tensor] = None,
        local_window_size: WindowLike = None,
        logits_soft_cap: Optional[float] = None,
        q_segment_ids: Optional[torch.Tensor] = None,
        kv_segment_ids: Optional[torch.Tensor] = None,
        return_residuals: bool = False,
        configs=None,
    ):
        """Attention output ``[B,T,N,Hv]``; ``(out, logsumexp[B,N,T])`` when return_residuals."""
        fwd, bwd = self._split_configs(configs)
        out, logsumexp = self._op(
            query,
            key,
            value,
            bias,
            mask,
            _optional_float(scale, "scale"),
            bool(is_causal),
            query_seq_lengths,
            key_value_seq_lengths,
            _window(local_window_size),
            _optional_float(logits_soft_cap, "logits_soft_cap"),
            q_segment_ids,
            kv_segment_ids,
            _configs.config_to_list(fwd),
            _configs.config_to_list(bwd),
        )
        return (out, logsumexp) if return_residuals else out

    def get_configs(self, query, key, value, bias=None, mask=None, *, is_causal=False, query_seq_lengths=None,
                    key_value_seq_lengths=None, local_window_size=None, q_segment_ids=None, **unused):
        """The heuristic (fwd, bwd) configs: exactly what a call with configs=None uses.

        The reference has no configs and returns (None, None). Works on meta tensors.
        """
        if not self.tunable:
            return None, None
        sparse = _block_sparse(is_causal, local_window_size, query_seq_lengths, key_value_seq_lengths, q_segment_ids)
        heuristic = torch.ops.tokamax._dot_product_attention_heuristic_config
        return (Config(*heuristic(query, key, value, sparse, PRODUCTS["forward"])),
                Config(*heuristic(query, key, value, sparse, PRODUCTS["backward"])))

    def config_space(self, query, key, value, bias=None, mask=None, *, product: str = "forward", is_causal=False,
                     query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None, q_segment_ids=None,
                     **unused) -> list[Config]:
        """Autotuning candidates, heuristic first, for the forward or the backward pass."""
        product_id = self._check_product(product)
        sparse = _block_sparse(is_causal, local_window_size, query_seq_lengths, key_value_seq_lengths, q_segment_ids)
        flat = torch.ops.tokamax._dot_product_attention_config_space(query, key, value, sparse, product_id)
        return self._configs_from_flat(flat)

    def assemble_configs(self, per_product: dict) -> tuple[Config, Config]:
        """(fwd, bwd) from one Config per product."""
        return per_product["forward"], per_product["backward"]

    def split_configs(self, configs: tuple[Config, Config]) -> dict:
        """The inverse of assemble_configs."""
        fwd, bwd = configs
        return {"forward": fwd, "backward": bwd}

    def cache_key(self, query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                  query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None, logits_soft_cap=None,
                  q_segment_ids=None, kv_segment_ids=None, return_residuals=False, configs=None,
                  product: str = "forward") -> dict:
        """The canonical argument spec an autotuning cache entry is stored under.

        Shapes and dtypes of every tensor (lengths and segment ids by shape only: their values
        change per batch), the causal flag, the normalised window, whether a soft cap is set,
        and the product. The scale does not change the work and is left out.
        """
        self._check_product(product)
        return {
            "query": _configs.tensor_spec(query),
            "key": _configs.tensor_spec(key),
            "value": _configs.tensor_spec(value),
            "bias": _configs.tensor_spec(bias),
            "mask": _configs.tensor_spec(mask),
            "is_causal": bool(is_causal),
            "local_window_size": _window(local_window_size),
            "query_seq_lengths": _configs.tensor_spec(query_seq_lengths),
            "key_value_seq_lengths": _configs.tensor_spec(key_value_seq_lengths),
            "segment_ids": _configs.tensor_spec(q_segment_ids),
            "logits_soft_cap": logits_soft_cap is not None,
            "product": product,
        }

    def autotuning_runner(self, query, key, value, bias=None, mask=None, *, product: str, configs=None,
                          return_residuals=False, seed: int = 0, **kwargs):
        """A function (config -> None) that runs `product` once with that config.

        Meta tensors become real ones: random floats, an all-visible mask, full sequence lengths
        and a single segment.
        """
        generator = torch.Generator().manual_seed(seed)
        q_len, kv_len = query.shape[1], key.shape[1]

        def real(t, name=None):
            if t is None or t.device.type != "meta":
                return t if t is None else t.detach()
            if t.dtype == torch.bool:
                return torch.ones(t.shape, dtype=torch.bool)
            if name == "query_seq_lengths":
                return torch.full(t.shape, q_len, dtype=t.dtype)
            if name == "key_value_seq_lengths":
                return torch.full(t.shape, kv_len, dtype=t.dtype)
            if not t.dtype.is_floating_point:
                return torch.zeros(t.shape, dtype=t.dtype)
            return torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype)

        query, key, value, bias, mask = (real(t) for t in (query, key, value, bias, mask))
        kwargs = {k: real(v, k) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        if product == "forward":
            def run(config):
                with torch.no_grad():
                    self(query, key, value, bias, mask, configs=(config, None), **kwargs)
            return run
        inputs = [t.requires_grad_(True) for t in (query, key, value)]

        def run(config):
            out = self(query, key, value, bias, mask, configs=(None, config), **kwargs)
            torch.autograd.grad(out, inputs, torch.ones_like(out))
        return run


reference = _DotProductAttention("reference", torch.ops.tokamax.dot_product_attention_reference.default)
kernel = _DotProductAttention("kernel", torch.ops.tokamax.dot_product_attention.default)

__all__ = ["Config", "kernel", "reference"]
