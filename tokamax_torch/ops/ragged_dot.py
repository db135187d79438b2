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


class _RaggedDot(_configs.OpSingleton):
    """A ragged_dot implementation; ``reference`` and ``kernel`` share this signature."""

    family = "ragged_dot"
    #: Products an autotuner tunes separately: the call itself and its two gradient products.
    product_ids = PRODUCTS
    config_cls = Config

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

    def get_configs(
        self,
        lhs: torch.Tensor,
        rhs: torch.Tensor,
        group_sizes: torch.Tensor,
        *,
        ragged_dot_dimension_numbers: DimensionNumbersLike = None,
        preferred_element_type: DTypeLike = None,
        configs=None,
    ) -> tuple[Optional[Config], Optional[BackwardConfig]]:
        """The heuristic (fwd, bwd) configs: exactly what a call with configs=None uses.

        The reference has no configs and returns (None, None).
        """
        if not self.tunable:
            return None, None
        args = _config_op_args(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, preferred_element_type)
        heuristic = torch.ops.tokamax._ragged_dot_heuristic_config
        return Config(*heuristic(*args, PRODUCTS["forward"])), BackwardConfig(
            Config(*heuristic(*args, PRODUCTS["dlhs"])), Config(*heuristic(*args, PRODUCTS["drhs"]))
        )

    def config_space(self, lhs, rhs, group_sizes, *, product: str = "forward", **kwargs) -> list[Config]:
        """Autotuning candidates, heuristic first, for the forward call or one gradient product."""
        product_id = self._check_product(product)
        flat = torch.ops.tokamax._ragged_dot_config_space(
            *_config_op_args(lhs, rhs, group_sizes, kwargs.get("ragged_dot_dimension_numbers"),
                             kwargs.get("preferred_element_type")),
            product_id,
        )
        return self._configs_from_flat(flat)


    def assemble_configs(self, per_product: dict) -> tuple[Config, BackwardConfig]:
        """(fwd, bwd) from one Config per product."""
        return per_product["forward"], BackwardConfig(per_product["dlhs"], per_product["drhs"])

    def split_configs(self, configs: tuple[Config, BackwardConfig]) -> dict:
        """The inverse of assemble_configs."""
        fwd, bwd = configs
        return {"forward": fwd, "dlhs": bwd.dlhs, "drhs": bwd.drhs}

    def cache_key(self, lhs, rhs, group_sizes, *, ragged_dot_dimension_numbers=None,
                  preferred_element_type=None, configs=None, product: str = "forward") -> dict:
        """The canonical argument spec an autotuning cache entry is stored under.

        Shapes and dtypes of the tensors, the dimension numbers (flat, DEFAULT when None), the
        output dtype and the product. Group sizes appear as their list of values when the caller
        passes representative sizes as a Python sequence, else by shape and dtype only.
        """
        self._check_product(product)
        out_dtype = _dtype(preferred_element_type)
        if isinstance(group_sizes, torch.Tensor):
            sizes = _configs.tensor_spec(group_sizes)
        else:
            sizes = {"values": [int(v) for v in group_sizes]}
        return {
            "lhs": _configs.tensor_spec(lhs),
            "rhs": _configs.tensor_spec(rhs),
            "group_sizes": sizes,
            "ragged_dot_dimension_numbers": _flat_dimension_numbers(ragged_dot_dimension_numbers)
            or DEFAULT.flatten(),
            "preferred_element_type": None if out_dtype is None else str(out_dtype).removeprefix("torch."),
            "product": product,
        }

    def autotuning_runner(self, lhs, rhs, group_sizes, *, product: str, ragged_dot_dimension_numbers=None,
                          preferred_element_type=None, configs=None, seed: int = 0):
        """A function (config -> None) that runs `product` once with that config.

        Meta tensors are replaced by random ones of the same shape; group sizes given by shape
        only become an even split. The gradient products run alone through autograd (only the
        input whose gradient is asked for is computed).
        """
        generator = torch.Generator().manual_seed(seed)

        def real(t):
            if t.device.type != "meta":
                return t.detach()
            return torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype)

        lhs, rhs = real(lhs), real(rhs)
        if isinstance(group_sizes, torch.Tensor) and group_sizes.device.type != "meta":
            sizes = group_sizes
        elif isinstance(group_sizes, torch.Tensor):
            g, m = group_sizes.shape[0], lhs.shape[0]
            sizes = torch.full((g,), m // g if g else 0, dtype=group_sizes.dtype)
        else:
            sizes = _group_sizes_tensor(group_sizes)
        kwargs = dict(ragged_dot_dimension_numbers=ragged_dot_dimension_numbers,
                      preferred_element_type=preferred_element_type)
        if product == "forward":
            def run(config):
                with torch.no_grad():
                    self(lhs, rhs, sizes, configs=(config, None), **kwargs)
            return run
        wrt = lhs.requires_grad_(True) if product == "dlhs" else rhs.requires_grad_(True)

        def run(config):
            out = self(lhs, rhs, sizes, configs=(None, config), **kwargs)
            torch.autograd.grad(out, wrt, torch.ones_like(out))
        return run


def _config_op_args(lhs, rhs, group_sizes, dimension_numbers, preferred_element_type):
    """The leading arguments of the _ragged_dot_heuristic_config / _config_space ops."""
    return (lhs, rhs, _group_sizes_tensor(group_sizes, lhs.device), _flat_dimension_numbers(dimension_numbers),
            _dtype(preferred_element_type))


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
