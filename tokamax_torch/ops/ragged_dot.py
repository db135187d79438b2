"""ragged_dot: the grouped matrix product of mixture-of-experts layers.

``ragged_dot(lhs[M,K], rhs[G,K,N], group_sizes[G]) -> out[M,N]``: group ``g`` owns rows
``[sum(gs[:g]), sum(gs[:g+1]))`` of ``lhs`` and multiplies them by ``rhs[g]``; rows past
``sum(group_sizes)`` are zero. The semantics are those of ``jax.lax.ragged_dot`` and Tokamax.
The math, checks and autograd live in C++ (``csrc/torch/ragged_dot.cc``); this module only
turns Python arguments into the schema's primitives.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch

from tokamax_torch import _op
from tokamax_torch import configs as _configs


@dataclasses.dataclass(frozen=True)
class RaggedDotDimensionNumbers:
    """Which dimensions contract, batch, are ragged and index the groups (as in JAX)."""

    lhs_contracting_dimensions: tuple[int, ...]
    rhs_contracting_dimensions: tuple[int, ...]
    lhs_batch_dimensions: tuple[int, ...]
    rhs_batch_dimensions: tuple[int, ...]
    lhs_ragged_dimensions: tuple[int, ...]
    rhs_group_dimensions: tuple[int, ...]

    def flatten(self) -> list[int]:
        """Tokamax's serialisation: six lengths, then the six lists concatenated."""
        lists = (
            self.lhs_contracting_dimensions,
            self.rhs_contracting_dimensions,
            self.lhs_batch_dimensions,
            self.rhs_batch_dimensions,
            self.lhs_ragged_dimensions,
            self.rhs_group_dimensions,
        )
        return [len(x) for x in lists] + [d for x in lists for d in x]


#: lhs[M,K] · rhs[G,K,N] -> out[M,N] (the forward product).
DEFAULT = RaggedDotDimensionNumbers((1,), (1,), (), (), (0,), (0,))
#: lhs[M,K] · rhs[G,N,K]ᵀ -> out[M,N] (the lhs gradient).
TRANS_RHS = RaggedDotDimensionNumbers((1,), (2,), (), (), (0,), (0,))
#: lhs[M,K], rhs[M,N] -> out[G,K,N], out[g] = lhs_rows(g)ᵀ · rhs_rows(g) (the rhs gradient).
RAGGED_CONTRACTING = RaggedDotDimensionNumbers((0,), (0,), (), (), (0,), ())


#: Blocking of the CPU kernel; its fields come from ``tokamax::RaggedDotConfig``'s field list.
Config = _configs.config_class(
    "ragged_dot", __name__, "Blocking of the ragged_dot CPU kernel (``tokamax::RaggedDotConfig``)."
)


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Configs of the two gradient products: the lhs gradient and the rhs gradient.

    ``configs=(fwd, bwd)`` takes a BackwardConfig, a single Config (used for both products) or
    None (each product uses the heuristic for its own shape, which is what get_configs returns).
    """

    dlhs: Config
    drhs: Config

    def to_list(self) -> list[int]:
        return self.dlhs.to_list() + self.drhs.to_list()


DimensionNumbersLike = Union[RaggedDotDimensionNumbers, Sequence[int], None]
DTypeLike = Union[torch.dtype, str, None]
ConfigLike = Union[Config, BackwardConfig, Sequence[int], None]
#: The call itself and its two gradient products, as declared in C++ (TOKAMAX_RAGGED_DOT_PRODUCTS).
PRODUCTS = _configs.products("ragged_dot")


def _flat_dimension_numbers(dimension_numbers: DimensionNumbersLike) -> Optional[list[int]]:
    if dimension_numbers is None:
        return None
    if isinstance(dimension_numbers, RaggedDotDimensionNumbers):
        return dimension_numbers.flatten()
    return [int(d) for d in dimension_numbers]


def _dtype(preferred_element_type: DTypeLike) -> Optional[torch.dtype]:
    if preferred_element_type is None or isinstance(preferred_element_type, torch.dtype):
        return preferred_element_type
    if isinstance(preferred_element_type, str) and isinstance(
        getattr(torch, preferred_element_type, None), torch.dtype
    ):
        return getattr(torch, preferred_element_type)
    raise TypeError(
        "ragged_dot: preferred_element_type must be a torch.dtype, a dtype name or None, "
        f"got {preferred_element_type!r}"
    )


class _RaggedDot(_op.Op):
    """A ragged_dot implementation; ``reference`` and ``kernel`` share this signature."""

    family = "ragged_dot"
    #: The forward call and its two gradient products, each tuned on its own.
    product_specs = _op.declared_products(PRODUCTS, wrt={"dlhs": ("lhs",), "drhs": ("rhs",)})
    config_cls = Config
    backward_config_cls = BackwardConfig
    summary = (
        "Forward and both gradients (higher derivatives too). CPU kernel with `scalar`, `avx2` and `avx512` ISA "
        "tiers; bf16 products run on the AVX512-BF16 dot instruction on the `avx512bf16` tier (Zen 4: 0.9-1.2x the "
        "fastest PyTorch bf16 path forward, 0.8-1.5x forward+backward) and on the AMX tile unit on the `amx` tier "
        "(Intel Xeon model 167, `intel_model167_amx`, 2 threads, 2026-12-06: bf16 1.31-1.99x the fastest "
        "PyTorch path, fp32 1.06-1.94x, every case of every tier at or above 1.0x but one noisy avx2 row; "
        "docs/benchmarks.md, issue 22). `torch.compile` (fullgraph, dynamic shapes) and "
        "`torch.export`. Configs through `get_configs` and `config_space`.")
    cli_shape = "M,K,N,G"

    def __call__(
        self,
        lhs: torch.Tensor,
        rhs: torch.Tensor,
        group_sizes: torch.Tensor,
        *,
        ragged_dot_dimension_numbers: DimensionNumbersLike = None,
        preferred_element_type: DTypeLike = None,
        configs=None,
    ) -> torch.Tensor:
        fwd, bwd = self._split_configs(configs)
        return self._op(
            lhs,
            rhs,
            group_sizes,
            _flat_dimension_numbers(ragged_dot_dimension_numbers),
            _dtype(preferred_element_type),
            _configs.config_to_list(fwd),
            _configs.config_to_list(bwd),
        )

    def canonicalize(self, arguments: dict) -> dict:
        """Dimension numbers flat (DEFAULT for None), the output dtype a torch.dtype, and group
        sizes given as a Python sequence (representative sizes) a tuple of ints."""
        sizes = arguments["group_sizes"]
        if not isinstance(sizes, torch.Tensor):  # 2.7 is not truncated to 2 (nor True taken for 1)
            arguments["group_sizes"] = tuple(_op.scalar_int(self.family, f"group_sizes[{i}]", v)
                                             for i, v in enumerate(sizes))
        arguments["ragged_dot_dimension_numbers"] = tuple(
            _flat_dimension_numbers(arguments["ragged_dot_dimension_numbers"]) or DEFAULT.flatten())
        arguments["preferred_element_type"] = _dtype(arguments["preferred_element_type"])
        return arguments

    def config_op_arguments(self, bound) -> tuple:
        lhs = bound["lhs"]
        return (lhs, bound["rhs"], _group_sizes_tensor(bound["group_sizes"], lhs.device),
                list(bound["ragged_dot_dimension_numbers"]), bound["preferred_element_type"])

    def cache_key_arguments(self, bound) -> dict:
        """Group sizes appear as their values when given as a Python sequence (representative
        sizes), else by shape and dtype only."""
        arguments = dict(bound.arguments)
        if not isinstance(arguments["group_sizes"], torch.Tensor):
            arguments["group_sizes"] = {"values": list(arguments["group_sizes"])}
        return arguments

    def real_argument(self, bound, name, value, generator):
        """Group sizes given by shape only become an even split of the rows."""
        if name != "group_sizes":
            return super().real_argument(bound, name, value, generator)
        if not isinstance(value, torch.Tensor):
            return _group_sizes_tensor(value)
        if value.device.type != "meta":
            return value
        g, m = value.shape[0], bound["lhs"].shape[0]
        return torch.full((g,), m // g if g else 0, dtype=value.dtype)

    def add_cli_arguments(self, parser) -> None:
        parser.add_argument("--form", default="default", choices=list(_FORMS),
                            help="the dimension numbers (default: lhs[M,K] rhs[G,K,N])")
        parser.add_argument("--group-sizes", default=None, help="representative group sizes, comma separated")

    def cli_call(self, shape: str, dtype: torch.dtype, options):
        try:
            m, k, n, g = (int(v) for v in shape.split(","))
        except ValueError:
            raise ValueError(f"--shape must be M,K,N,G (four ints), got {shape!r}") from None
        meta = dict(device="meta", dtype=dtype)
        rhs = {"default": (g, k, n), "trans_rhs": (g, n, k), "ragged_contracting": (m, n)}[options.form]
        if options.group_sizes:
            try:
                sizes = [int(v) for v in options.group_sizes.split(",")]
            except ValueError:
                raise ValueError(f"--group-sizes must be ints, comma separated, got {options.group_sizes!r}") from None
        else:
            sizes = torch.empty(g, device="meta", dtype=torch.int32)
        return self.bind(torch.empty(m, k, **meta), torch.empty(*rhs, **meta), sizes,
                         ragged_dot_dimension_numbers=_FORMS[options.form])


_FORMS = {"default": DEFAULT, "trans_rhs": TRANS_RHS, "ragged_contracting": RAGGED_CONTRACTING}


def _group_sizes_tensor(group_sizes, device=None):
    """Representative group sizes may be given as a Python sequence of ints (placed on `device`,
    e.g. meta when the other arguments are meta tensors)."""
    if isinstance(group_sizes, torch.Tensor):
        return group_sizes
    return torch.tensor([int(v) for v in group_sizes], dtype=torch.int32, device=device)


reference = _RaggedDot("reference", torch.ops.tokamax.ragged_dot_reference.default)
kernel = _RaggedDot("kernel", torch.ops.tokamax.ragged_dot.default)

__all__ = [
    "BackwardConfig",
    "Config",
    "DEFAULT",
    "RAGGED_CONTRACTING",
    "RaggedDotDimensionNumbers",
    "TRANS_RHS",
    "kernel",
    "reference",
]
