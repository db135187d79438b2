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

from tokamax_torch import _op
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
    return _op.scalar_float("dot_product_attention", name, value, optional=True)


def _flag(value, name: str) -> bool:
    return _op.scalar_flag("dot_product_attention", name, value)


def _block_sparse(is_causal, local_window_size, query_seq_lengths, key_value_seq_lengths, q_segment_ids,
                  mask) -> bool:
    """Whether some mask lets the kernel skip whole kv tiles (the heuristics tile finer then); a
    bool mask counts, as in the C++ call (FoldMaskRuns makes most of them ranges)."""
    return bool(is_causal) or local_window_size is not None or query_seq_lengths is not None or (
        key_value_seq_lengths is not None) or q_segment_ids is not None or mask is not None


class _DotProductAttention(_op.Op):
    """A dot_product_attention implementation; ``reference`` and ``kernel`` share this signature."""

    family = "dot_product_attention"
    #: The forward call and its backward (dq, dk, dv and dbias in one pass), each tuned on its own.
    product_specs = _op.declared_products(PRODUCTS, wrt={"backward": ("query", "key", "value")})
    config_cls = Config
    summary = (
        "Forward and backward (dq, dk, dv, dbias; logsumexp differentiable). GQA/MQA, causal (top-left), sliding "
        "window, sequence lengths, packed segments, bool mask, bias, soft cap; fully masked rows give zeros, never "
        "NaN. Flash-style CPU kernel that skips masked kv tiles, FlashAttention-2 backward, split-kv decode. "
        "`torch.compile` (fullgraph, dynamic shapes) and `torch.export`. Configs through `get_configs` and "
        "`config_space`. On the Zen 4 VM (docs/benchmarks.md, runs J-R), against SDPA: fp32 1.36-1.7x forward and "
        "1.38-1.75x forward+backward, GQA 32/8 1.45-2.1x (SDPA's own efficiency moves it; the 1.5x target is not "
        "reliably met), window/packed 5-12x; bf16 prefill on the AVX512-BF16 dot instruction (`avx512bf16` tier) "
        "2.4-3.3x forward and 1.95-2.2x forward+backward (at the 2x target); decode 4-54x SDPA at 23-27 GB/s, "
        "66-77% of a plain read of the same caches in runs M-R (the 70% target is not reliably met; bound by the "
        "access pattern of one kv head's rows, not the arithmetic). On CPUs with AMX (`amx` tier) bf16 prefill runs "
        "on the tile unit (Intel Xeon model 167, 2026-12-06: 1.81-2.15x SDPA forward+backward, 1.17-1.31x "
        "forward; fp32 1.30-1.42x). Per-call working memory above 1 MiB is mapped in huge pages and cached for "
        "the next call (`empty_cache()`).")
    cli_shape = "B,T,S,N,K,H[,Hv]"

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
            _flag(is_causal, "is_causal"),
            query_seq_lengths,
            key_value_seq_lengths,
            _window(local_window_size),
            _optional_float(logits_soft_cap, "logits_soft_cap"),
            q_segment_ids,
            kv_segment_ids,
            _configs.config_to_list(fwd),
            _configs.config_to_list(bwd),
        )
        return (out, logsumexp) if _flag(return_residuals, "return_residuals") else out

    def canonicalize(self, arguments: dict) -> dict:
        """The window as its (left, right) sides, the flags as bools, the numbers as floats."""
        arguments["scale"] = _optional_float(arguments["scale"], "scale")
        arguments["logits_soft_cap"] = _optional_float(arguments["logits_soft_cap"], "logits_soft_cap")
        arguments["is_causal"] = _flag(arguments["is_causal"], "is_causal")
        arguments["return_residuals"] = _flag(arguments["return_residuals"], "return_residuals")
        window = _window(arguments["local_window_size"])
        arguments["local_window_size"] = None if window is None else tuple(window)
        return arguments

    def config_op_arguments(self, bound) -> tuple:
        sparse = _block_sparse(*(bound[name] for name in ("is_causal", "local_window_size", "query_seq_lengths",
                                                           "key_value_seq_lengths", "q_segment_ids", "mask")))
        return bound["query"], bound["key"], bound["value"], sparse

    def cache_key_arguments(self, bound) -> dict:
        """Every tensor by shape and dtype (lengths and segment ids too: their values change per
        batch), the causal flag, the window, whether a soft cap is set. The scale does not change
        the work and is left out."""
        names = ("query", "key", "value", "bias", "mask", "is_causal", "local_window_size", "query_seq_lengths",
                 "key_value_seq_lengths")
        return {**{name: bound[name] for name in names}, "segment_ids": bound["q_segment_ids"],
                "logits_soft_cap": bound["logits_soft_cap"] is not None}

    def real_argument(self, bound, name, value, generator):
        """Meta sequence lengths become full lengths (every position seen)."""
        if isinstance(value, torch.Tensor) and value.device.type == "meta" and name in _FULL_LENGTH:
            return torch.full(value.shape, bound[_FULL_LENGTH[name]].shape[1], dtype=value.dtype)
        return super().real_argument(bound, name, value, generator)

    def add_cli_arguments(self, parser) -> None:
        parser.add_argument("--causal", action="store_true", help="is_causal=True")
        parser.add_argument("--window", default=None, help="local_window_size, W or LEFT,RIGHT")
        parser.add_argument("--soft-cap", type=float, default=None, help="logits_soft_cap")

    def cli_call(self, shape: str, dtype: torch.dtype, options):
        try:
            dims = [int(v) for v in shape.split(",")]
            if len(dims) not in (6, 7):
                raise ValueError
        except ValueError:
            raise ValueError(f"--shape must be B,T,S,N,K,H or B,T,S,N,K,H,Hv (six or seven ints), "
                             f"got {shape!r}") from None
        b, t, s, n, k, h = dims[:6]
        hv = dims[6] if len(dims) == 7 else h
        window = None
        if options.window is not None:
            try:
                sides = tuple(int(v) for v in options.window.split(","))
                if len(sides) not in (1, 2):
                    raise ValueError
            except ValueError:
                raise ValueError(f"--window must be W or LEFT,RIGHT (ints), got {options.window!r}") from None
            window = sides[0] if len(sides) == 1 else sides
        meta = dict(device="meta", dtype=dtype)
        return self.bind(torch.empty(b, t, n, h, **meta), torch.empty(b, s, k, h, **meta),
                         torch.empty(b, s, k, hv, **meta), is_causal=options.causal, local_window_size=window,
                         logits_soft_cap=options.soft_cap)


#: Sequence-length arguments and the input whose dim 1 is their full length.
_FULL_LENGTH = {"query_seq_lengths": "query", "key_value_seq_lengths": "key"}


reference = _DotProductAttention("reference", torch.ops.tokamax.dot_product_attention_reference.default)
kernel = _DotProductAttention("kernel", torch.ops.tokamax.dot_product_attention.default)

__all__ = ["Config", "kernel", "reference"]
