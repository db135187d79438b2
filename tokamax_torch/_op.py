"""The op base class: each op family writes its signature once and binds calls to it.

An op family (``ragged_dot``, ``dot_product_attention``, ...) is a subclass of ``Op`` with two
singletons, ``reference`` and ``kernel``. Its ``__call__`` is the only place the call signature
is written. ``op.bind(*args, **kwargs)`` checks a call's arguments against that signature, puts
them in canonical form and returns a ``BoundArguments``, from which the config machinery works:
the heuristic configs, the autotuning search space, the cache key and the autotuning runner.
So none of them repeats the signature (Tokamax's ``Op.bind`` / ``BoundArguments`` design).

Creating a singleton registers it (``tokamax_torch._registry``); ``tokamax_torch.ops``, the
autotuning command line and the README's op table are built from the registry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import numbers
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from tokamax_torch import _registry, _vmap


@dataclasses.dataclass(frozen=True)
class Product:
    """A pass of an op that has its own config and is autotuned on its own.

    ``id`` is the product number the op's C++ config ops take. ``wrt`` names the forward inputs
    whose gradient runs this product; ``()`` is the forward call itself.
    """

    name: str
    id: int
    wrt: tuple[str, ...] = ()


def declared_products(names: Sequence[str], wrt: dict[str, tuple[str, ...]]) -> tuple[Product, ...]:
    """Products from the names the C++ op declares, in their order (the order is the id)."""
    unknown = set(wrt) - set(names)
    if unknown:
        raise ValueError(f"products {sorted(unknown)} are not among the declared {list(names)}")
    return tuple(Product(name, index, wrt.get(name, ())) for index, name in enumerate(names))


def scalar_int(family: str, name: str, value, *, optional: bool = False):
    """An int argument as an int (a SymInt under torch.compile stays one); TypeError naming it for
    anything else: a float is not truncated, a bool is not a count."""
    if value is None and optional:
        return None
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"{family}: {name} must be an int{' or None' if optional else ''}, got {value!r}")


def scalar_float(family: str, name: str, value, *, optional: bool = False):
    """A float argument as a float (ints accepted); TypeError naming it for anything else."""
    if value is None and optional:
        return None
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{family}: {name} must be a number{' or None' if optional else ''}, got {value!r}")


def scalar_flag(family: str, name: str, value) -> bool:
    """A bool argument (0 and 1 accepted); TypeError naming it for anything else: a string such as
    "False" would be truthy."""
    if isinstance(value, torch.SymBool):
        return value
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and value.dtype.kind == "b"):  # numpy's too
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{family}: {name} must be a bool, got {value!r}")


def argument_spec(value) -> Any:
    """A bound argument as a JSON-able cache-key value: tensors by shape and dtype only."""
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (tuple, list)):
        return [argument_spec(v) for v in value]
    if isinstance(value, dict):
        return {k: argument_spec(v) for k, v in value.items()}
    return value


def columns_contiguous(*weights) -> bool:
    """Whether every weight's columns (last dim) are contiguous: a GEMM of few rows then reads it in
    place, with its own blocking, so the cache keys of ops whose heuristic looks at it hold it."""
    return all(w.shape[-1] <= 1 or w.stride(-1) == 1 for w in weights if w is not None)


@dataclasses.dataclass(frozen=True)
class ConfigRecord:
    """The config one kernel call ran with, as the C++ adapter resolved it (``record_configs``).

    ``family`` is the op, ``product`` the product the call ran (a gradient product run as another
    call of the op is named as the gradient product), ``config`` the values in field order
    (``Config.to_list()``), ``given`` whether the caller gave it (False: the heuristic chose it).
    """

    family: str
    product: str
    config: tuple[int, ...]
    given: bool


@contextlib.contextmanager
def record_configs():
    """Records the config of every kernel call made in the block, in call order.

    Yields a list that holds the ``ConfigRecord`` of each call once the block exits. Every kernel
    resolves its config in one C++ function (``ConfigOrHeuristic``, ``csrc/torch/op_kit.h``), which
    appends to a process-wide record while this is active: a test sees which config ran instead of
    inferring it from the bits. Compiled code records too; the product of a gradient that runs as
    another call of the op is only known in eager autograd (compiled, it is recorded as that
    call's ``forward``). Not reentrant; for tests.
    """
    records: list[ConfigRecord] = []
    torch.ops.tokamax._record_configs(True)
    try:
        yield records
    finally:
        ops, products, sizes, values, given = torch.ops.tokamax._recorded_configs()
        torch.ops.tokamax._record_configs(False)
        start = 0
        for op, product, size, was_given in zip(ops, products, sizes, given):
            records.append(ConfigRecord(op, product, tuple(values[start:start + size]), bool(was_given)))
            start += size


class BoundArguments:
    """An op and the arguments of one call, checked and in canonical form.

    ``arguments`` maps every parameter of the op's signature except ``configs``, in signature
    order, to the value given or its default, as the op's ``canonicalize`` normalises it.
    Tensors may be meta tensors: nothing here reads tensor values.
    """

    __slots__ = ("op", "arguments")

    def __init__(self, op: "Op", arguments: Mapping[str, Any]) -> None:
        self.op = op
        self.arguments = dict(arguments)

    def __getitem__(self, name: str):
        return self.arguments[name]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={argument_spec(v)!r}" for k, v in self.arguments.items())
        return f"BoundArguments({self.op!r}, {args})"

    def __call__(self, configs=None):
        """Runs the op on these arguments (real tensors; see ``autotuning_runner`` for meta ones)."""
        return self.op(**self.arguments, configs=configs)

    def heuristic_config(self, product: str):
        """The config the op picks for `product` when called with ``configs=None``."""
        spec = self.op.product(product)
        return self.op.config_cls(*self.op.heuristic_config_values(self, spec.id))

    def heuristic_configs(self) -> tuple:
        """The heuristic ``(fwd, bwd)``: exactly what a call with ``configs=None`` uses.
        ``(None, None)`` for an op without configs (the reference)."""
        if not self.op.tunable:
            return None, None
        return self.op.assemble_configs({p: self.heuristic_config(p) for p in self.op.products})

    def config_space(self, product: str = "forward") -> list:
        """Autotuning candidates for `product`, heuristic first, each valid."""
        spec = self.op.product(product)
        flat = self.op.config_space_values(self, spec.id)
        width = len(dataclasses.fields(self.op.config_cls))
        return [self.op.config_cls(*flat[i:i + width]) for i in range(0, len(flat), width)]

    def cache_key(self, product: str = "forward") -> dict:
        """The canonical argument spec an autotuning cache entry for `product` is stored under."""
        self.op.product(product)
        key = {name: argument_spec(value) for name, value in self.op.cache_key_arguments(self).items()}
        key["product"] = product
        return key

    def autotuning_runner(self, product: str, seed: int = 0) -> Callable[[Any], None]:
        """A function (config -> None) that runs `product` once with that config.

        Meta tensors become real ones (``op.real_argument``). A gradient product runs alone
        through autograd: only the inputs it differentiates require grad. A donated argument
        (a KV cache) is copied first: every run writes it, and the caller's must stay as it was.
        """
        spec = self.op.product(product)
        generator = torch.Generator().manual_seed(seed)
        arguments = {name: self.op.real_argument(self, name, value, generator)
                     for name, value in self.arguments.items()}
        for name in self.op.donated_args:
            given = self.arguments.get(name)
            if isinstance(given, torch.Tensor) and given.device.type != "meta":
                arguments[name] = arguments[name].clone()
        if not spec.wrt:
            def run_forward(config) -> None:
                with torch.no_grad():
                    self.op(**arguments, configs=(config, None))
            return run_forward
        wrt = [arguments[name].requires_grad_(True) for name in spec.wrt]

        def run_backward(config) -> None:
            out = self.op(**arguments, configs=(None, config))
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.grad(out, wrt, torch.ones_like(out))
        return run_backward


class Op:
    """What the ``reference`` and ``kernel`` singletons of every op family share.

    A subclass sets ``family`` (the kernel op's name in ``torch.ops.tokamax``, the module name
    under ``tokamax_torch.ops``, the name in cache files and on the command line),
    ``product_specs`` (the products an autotuner tunes separately, forward first),
    ``config_cls``, ``backward_config_cls`` when it has several backward products, and
    ``summary`` (its line in the README's op table). An op without configs (no C++ Config)
    leaves ``product_specs`` and ``config_cls`` unset: its ``get_configs`` is ``(None, None)``,
    ``config_space``, ``cache_key`` and ``autotune`` raise ValueError saying it has no configs. It writes ``__call__`` and may override
    the hooks below (``canonicalize``, ``config_op_arguments``, ``cache_key_arguments``,
    ``real_argument``) and the command-line ones (``cli_shape``, ``add_cli_arguments``,
    ``cli_call``).
    """

    family: str
    product_specs: tuple[Product, ...] = ()
    config_cls: Optional[type] = None
    backward_config_cls: Optional[type] = None
    summary: str = ""
    #: The parameters of ``__call__`` whose buffers the op donates: written in place and returned
    #: (same storage), never copied (docs/design.md, "Buffer donation"). They must be exactly the
    #: arguments the op's schema marks mutable (``Tensor(a!)``); ``__call__`` returns them through
    #: ``_call_donating``.
    donated_args: tuple[str, ...] = ()
    #: The ``--shape`` format on the autotuning command line, e.g. ``"M,K,N,G"``; None keeps
    #: the op off the command line.
    cli_shape: Optional[str] = None

    def __init__(self, name: str, op) -> None:
        if name not in _registry.SINGLETONS:
            raise ValueError(f"{type(self).__name__}: name must be one of {_registry.SINGLETONS}, got {name!r}")
        # An op without configs (no C++ Config) declares neither; an op with configs both.
        if bool(self.product_specs) != (self.config_cls is not None):
            raise TypeError(f"{type(self).__name__}: product_specs and config_cls are declared together "
                            f"(an op without configs leaves both unset), got {len(self.product_specs)} products "
                            f"and config_cls={self.config_cls!r}")
        self.name = name
        self._op = op
        self._signature = inspect.signature(self.__call__)
        self._donated_positions = self._check_donated_args(op)
        if getattr(op, "_schema", None) is not None:
            _vmap.register(op, tuple(self.donated_args))
        _registry.register(self)

    # ---- the call -------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define __call__, the op's signature")

    @property
    def op(self):
        """The registered ``torch.ops.tokamax`` overload this singleton calls."""
        return self._op

    @property
    def tunable(self) -> bool:
        """Whether configs change what this singleton runs: the kernel's do, the reference's not."""
        return self.name == "kernel" and bool(self.product_specs)

    @property
    def products(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.product_specs)

    def product(self, name: str) -> Product:
        """The product called `name`; ValueError for an unknown one, or for any name when the op
        has no configs."""
        if not self.product_specs:
            raise ValueError(f"{self.family}: the op has no configs (no products to configure or tune)")
        for spec in self.product_specs:
            if spec.name == name:
                return spec
        raise ValueError(f"{self.family}: product must be one of {list(self.products)}, got {name!r}")

    def __repr__(self) -> str:
        return f"tokamax_torch.ops.{self.family}.{self.name}"

    def _split_configs(self, configs) -> tuple:
        """``configs=(fwd, bwd)`` or None, as the pair (fwd, bwd). A Config object must be this
        op's: the C++ side checks only the field count and bounds, so another op's Config of the
        same width would run with its fields reinterpreted by position. An op without backward
        products takes None as bwd."""
        if configs is None:
            return None, None
        if not isinstance(configs, (tuple, list)) or len(configs) != 2:
            raise TypeError(f"{self.family}: configs must be a (fwd, bwd) pair or None, got {configs!r}")
        fwd, bwd = configs
        own = tuple(c for c in (self.config_cls, self.backward_config_cls) if c is not None)
        for name, config, allowed in (("configs[0]", fwd, own[:1]), ("configs[1]", bwd, own)):
            if dataclasses.is_dataclass(config) and not isinstance(config, allowed):
                raise TypeError(f"{self.family}: {name} must be {' or '.join(c.__qualname__ for c in allowed) or 'None'} "
                                f"of {self.family} (or a sequence of ints, or None), got {type(config).__module__}."
                                f"{type(config).__qualname__}")
        if bwd is not None and not any(spec.wrt for spec in self.product_specs):
            raise TypeError(f"{self.family}: the op has no backward config; configs[1] must be None, got {bwd!r}")
        return fwd, bwd

    def _check_donated_args(self, op) -> tuple[int, ...]:
        """The schema positions of ``donated_args``; TypeError unless they are exactly the schema's
        mutable arguments (a mutable argument not declared donated would be written silently; a
        donated one not mutable would be copied by functionalization)."""
        schema = getattr(op, "_schema", None)
        if schema is None:
            if self.donated_args:
                raise TypeError(f"{type(self).__name__}: donated_args need an op with a schema, got {op!r}")
            return ()
        names = [a.name for a in schema.arguments]
        mutable = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
        if tuple(self.donated_args) != mutable:
            raise TypeError(f"{type(self).__name__}: donated_args must be the schema's mutable arguments {mutable} "
                            f"in order, got {tuple(self.donated_args)}")
        missing = [a for a in self.donated_args if a not in self._signature.parameters]
        if missing:
            raise TypeError(f"{type(self).__name__}: donated_args {missing} are not parameters of __call__")
        return tuple(names.index(a) for a in self.donated_args)

    def _call_donating(self, *schema_args):
        """Calls the op (which writes its donated arguments in place) and returns the donated
        arguments themselves: one tensor, or a tuple of several; for an op that also returns
        results of its own, the pair (results, donated). Under torch.compile the mutation is
        functionalized and reinplaced: no copy (design.md)."""
        results = self._op(*schema_args)
        positions = self._donated_positions
        # One donated buffer (every op so far) without building a tuple: part of a decode-sized
        # call's fixed cost.
        donated = schema_args[positions[0]] if len(positions) == 1 else tuple(schema_args[i] for i in positions)
        return donated if results is None else (results, donated)

    def donated_outputs(self, result) -> tuple:
        """The donated buffers among what ``__call__`` returned, in ``donated_args`` order: by
        default the result itself (one tensor or a tuple of them). An op that returns results of
        its own beside them overrides this (the donation proofs find the buffers here)."""
        return result if isinstance(result, tuple) else (result,)

    # ---- binding --------------------------------------------------------------------------

    def bind(self, *args, **kwargs) -> BoundArguments:
        """Checks a call's arguments against the signature of ``__call__`` and normalises them.
        ``configs``, if given, is left out: it is what the bound arguments choose."""
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.family}: {exc}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop("configs", None)
        return BoundArguments(self, self.canonicalize(arguments))

    def canonicalize(self, arguments: dict) -> dict:
        """The arguments in canonical form: one value for each way of writing the same call, so
        equal calls get equal cache keys. Raises TypeError naming a malformed argument."""
        return arguments

    # ---- configs --------------------------------------------------------------------------

    def config_op_arguments(self, bound: BoundArguments) -> tuple:
        """The leading arguments of the op's C++ config ops (heuristic and space), which end in
        the product id."""
        raise NotImplementedError(f"{self.family}: config_op_arguments is not defined")

    def heuristic_config_values(self, bound: BoundArguments, product_id: int) -> list[int]:
        config_op = getattr(torch.ops.tokamax, f"_{self.family}_heuristic_config")
        return config_op(*self.config_op_arguments(bound), product_id)

    def config_space_values(self, bound: BoundArguments, product_id: int) -> list[int]:
        """The search space as the configs' values concatenated in field order."""
        config_op = getattr(torch.ops.tokamax, f"_{self.family}_config_space")
        return config_op(*self.config_op_arguments(bound), product_id)

    def assemble_configs(self, per_product: Mapping[str, Any]) -> tuple:
        """``(fwd, bwd)`` from one config per product: bwd is None for an op without a backward
        product, the backward product's config, or ``backward_config_cls`` of the backward
        products' configs in order when there are several."""
        forward, *backward = self.product_specs
        if not backward:
            return per_product[forward.name], None
        if len(backward) == 1:
            return per_product[forward.name], per_product[backward[0].name]
        return per_product[forward.name], self.backward_config_cls(*(per_product[p.name] for p in backward))

    def split_configs(self, configs: tuple) -> dict:
        """The inverse of assemble_configs."""
        fwd, bwd = configs
        forward, *backward = self.product_specs
        if not backward:
            return {forward.name: fwd}
        if len(backward) == 1:
            return {forward.name: fwd, backward[0].name: bwd}
        return {forward.name: fwd, **{p.name: getattr(bwd, p.name) for p in backward}}

    def cache_key_arguments(self, bound: BoundArguments) -> dict:
        """The arguments a cache key holds, before ``argument_spec``: by default all of them.
        An op leaves out what does not change which config is fastest."""
        return bound.arguments

    def real_argument(self, bound: BoundArguments, name: str, value, generator: torch.Generator):
        """`value` as the autotuning runner passes it: a meta tensor becomes a real one (random
        floats, all-true bools, zero integers); other values pass through detached."""
        if not isinstance(value, torch.Tensor):
            return value
        if value.device.type != "meta":
            return value.detach()
        if value.dtype == torch.bool:
            return torch.ones(value.shape, dtype=torch.bool)
        if value.dtype.is_floating_point:
            return torch.randn(value.shape, generator=generator, dtype=torch.float32).to(value.dtype)
        return torch.zeros(value.shape, dtype=value.dtype)

    # ---- the public raw-argument forms ----------------------------------------------------

    def get_configs(self, *args, **kwargs) -> tuple:
        """The heuristic ``(fwd, bwd)`` configs: exactly what a call with ``configs=None`` uses.
        The reference has no configs and returns ``(None, None)``. Works on meta tensors."""
        return self.bind(*args, **kwargs).heuristic_configs()

    def config_space(self, *args, product: str = "forward", **kwargs) -> list:
        """Autotuning candidates for `product`, heuristic first (the kernel's, on both singletons)."""
        return self.bind(*args, **kwargs).config_space(product)

    def cache_key(self, *args, product: str = "forward", **kwargs) -> dict:
        """The canonical argument spec an autotuning cache entry is stored under."""
        return self.bind(*args, **kwargs).cache_key(product)

    # ---- the autotuning command line ------------------------------------------------------

    def add_cli_arguments(self, parser) -> None:
        """Adds the op's own flags to its ``argparse`` sub-command."""

    def cli_call(self, shape: str, dtype: torch.dtype, options) -> BoundArguments:
        """The call (meta tensors) that ``--shape`` `shape`, `dtype` and the op's flags in
        `options` describe. Raises ValueError saying what is malformed."""
        raise NotImplementedError(f"{self.family}: not on the autotuning command line")
