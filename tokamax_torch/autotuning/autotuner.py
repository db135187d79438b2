"""The autotuner: times the heuristic config and the op's search space, product by product.

``autotune(op, *args, **kwargs)`` runs each candidate with warm-up and takes the median of
repeated runs, within an optional time budget, writes the results to the user cache and
returns an ``AutotuningResult``. ``lookup_configs`` is the cache side of
``get_configs(..., from_autotuning_cache=True)``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import time
import warnings
from typing import Optional

import torch

from tokamax_torch import _registry
from tokamax_torch.autotuning.cache import ConfigCache, canonical_key


def _device_kind() -> str:
    import tokamax_torch

    return tokamax_torch.device_kind()


def _metadata() -> dict:
    import tokamax_torch

    return {"tokamax_torch": tokamax_torch.__version__, "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def bind_call(op, args: tuple, kwargs: dict):
    """`op` bound to the call's arguments; `op` may already be a BoundArguments (then with no
    arguments)."""
    from tokamax_torch._op import BoundArguments, Op

    if isinstance(op, BoundArguments):
        if args or kwargs:
            raise TypeError("autotuning: BoundArguments already hold the call's arguments; pass no others, got "
                            f"{len(args)} positional and {sorted(kwargs)} keyword arguments")
        return op
    if not isinstance(op, Op):
        raise TypeError("autotuning: expected a tokamax_torch op singleton such as tokamax_torch.ragged_dot, "
                        f"got {op!r}")
    return op.bind(*args, **kwargs)


def lookup_configs(op, *args, **kwargs):
    """(fwd, bwd) from the cache for these arguments, each product falling back to its heuristic
    on a miss; a miss warns or raises as ``tokamax_torch.config.autotuning_cache_miss`` says.
    `op` may be a BoundArguments instead of an op and its arguments."""
    from tokamax_torch._settings import config as settings

    bound = bind_call(op, args, kwargs)
    op = bound.op
    if not op.tunable:
        return None, None
    cache = ConfigCache(op.family, _device_kind(), op.config_cls)
    chosen, missed = {}, []
    for product in op.products:
        key = bound.cache_key(product)
        hit = cache.lookup(key)
        if hit is None:
            missed.append(canonical_key(key))
        chosen[product] = hit if hit is not None else bound.heuristic_config(product)
    if missed and settings.autotuning_cache_miss != "heuristics":
        message = (f"tokamax_torch: no autotuned {op.family} config for {len(missed)} of "
                   f"{len(op.products)} products on {cache.device_kind}; keys: {missed}")
        if settings.autotuning_cache_miss == "error":
            raise LookupError(message)
        warnings.warn(message + "; using heuristic configs", RuntimeWarning, stacklevel=3)
    return op.assemble_configs(chosen)


@dataclasses.dataclass
class ProductResult:
    product: str
    key: dict
    heuristic: object
    best: object
    results: list  # [{"config", "median_ms", "min_ms", "samples"}], fastest first

    def timing(self, config) -> Optional[dict]:
        return next((r for r in self.results if r["config"] == config), None)


@dataclasses.dataclass
class AutotuningResult:
    """What an autotuning run measured: per product, every config's timing statistics."""

    op: str
    device_kind: str
    products: list  # [ProductResult]
    metadata: dict
    cache_path: Optional[str] = None
    untuned: dict = dataclasses.field(default_factory=dict)  # product -> its heuristic config

    @property
    def configs(self):
        """The best (fwd, bwd) pair, ready for ``configs=``; a product the run did not tune
        (``products=``) takes its heuristic config."""
        best = dict(self.untuned)
        best.update({p.product: p.best for p in self.products})
        return _registry.family(self.op).kernel.assemble_configs(best)

    def __str__(self) -> str:
        lines = [f"autotuning {self.op} on {self.device_kind}",
                 f"{'product':<9}{'configs':>8}{'heuristic ms':>14}{'best ms':>10}{'speed-up':>10}  best config"]
        for p in self.products:
            h, b = p.timing(p.heuristic), p.timing(p.best)
            speed = f"{h['median_ms'] / b['median_ms']:.2f}x" if h and b and b["median_ms"] > 0 else "n/a"
            h_ms = f"{h['median_ms']:.3f}" if h else "n/a"
            lines.append(f"{p.product:<9}{len(p.results):>8}{h_ms:>14}{b['median_ms']:>10.3f}{speed:>10}  "
                         f"{list(dataclasses.astuple(p.best))}")
        if self.cache_path:
            lines.append(f"written to {self.cache_path}")
        return "\n".join(lines)

    def dumps(self) -> str:
        def results(p):
            return [{"config": dataclasses.asdict(r["config"]), **{k: r[k] for k in ("median_ms", "min_ms", "samples")}}
                    for r in p.results]
        return json.dumps({
            "op": self.op, "device_kind": self.device_kind, "metadata": self.metadata, "cache_path": self.cache_path,
            "products": [{"product": p.product, "key": p.key, "heuristic": dataclasses.asdict(p.heuristic),
                          "best": dataclasses.asdict(p.best), "results": results(p)} for p in self.products],
        }, indent=1)

    @classmethod
    def loads(cls, text: str) -> "AutotuningResult":
        data = json.loads(text)
        config_cls = _registry.family(data["op"]).kernel.config_cls
        products = []
        for p in data["products"]:
            results = [{"config": config_cls(**r["config"]), "median_ms": float(r["median_ms"]),
                        "min_ms": float(r["min_ms"]), "samples": int(r["samples"])} for r in p["results"]]
            products.append(ProductResult(p["product"], p["key"], config_cls(**p["heuristic"]),
                                          config_cls(**p["best"]), results))
        return cls(data["op"], data["device_kind"], products, data["metadata"], data.get("cache_path"))

    def __eq__(self, other) -> bool:
        return isinstance(other, AutotuningResult) and self.dumps() == other.dumps()


def _time(run, config, warmup: int, reps: int) -> dict:
    for _ in range(warmup):
        run(config)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(config)
        samples.append((time.perf_counter() - t0) * 1e3)
    return {"config": config, "median_ms": statistics.median(samples), "min_ms": min(samples), "samples": reps}


def autotune(op, *args, products=None, warmup: int = 1, reps: int = 5, budget_s: Optional[float] = None,
             max_configs: Optional[int] = None, write_cache: bool = True, progress: bool = True,
             **kwargs) -> AutotuningResult:
    """Times the heuristic config and the search space of `op` for these arguments.

    `op` is an op singleton followed by its call's arguments, or a BoundArguments
    (``op.bind(...)``) alone. products: which of ``op.products`` to tune (default all: the
    forward call and each gradient product). Candidates are the op's ``config_space`` (already
    pruned by the C++ Validate()), heuristic first. budget_s: a wall-clock budget for the whole
    run, split evenly between the products; once a product's share is spent its remaining
    candidates are skipped (its heuristic is always timed). Results are merged into the user
    cache unless write_cache=False. Meta tensors are allowed: inputs of their shapes are made.
    """
    bound = bind_call(op, args, kwargs)
    op = bound.op
    if not op.tunable:
        raise ValueError(f"autotuning: {op!r} has no configs to tune")
    if reps < 1 or warmup < 0:
        raise ValueError(f"autotuning: reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    products = [products] if isinstance(products, str) else list(products or op.products)
    for p in products:
        op.product(p)  # ValueError naming the products for an unknown one
    candidates = {p: bound.config_space(p) for p in products}
    if max_configs is not None:
        candidates = {p: c[:max(1, max_configs)] for p, c in candidates.items()}
    total = sum(len(c) for c in candidates.values())
    bar = None
    if progress:
        try:  # tqdm is an optional extra: the run time depends on torch only
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=total, desc=f"autotuning {op.family}", unit="config", leave=False)
    measured = []
    try:
        for product in products:
            run = bound.autotuning_runner(product)
            deadline = None if budget_s is None else time.monotonic() + budget_s / len(products)
            results = []
            for i, config in enumerate(candidates[product]):
                if i > 0 and deadline is not None and time.monotonic() > deadline:
                    break
                results.append(_time(run, config, warmup, reps))
                if bar is not None:
                    bar.update(1)
            results.sort(key=lambda r: r["median_ms"])
            measured.append(ProductResult(product, bound.cache_key(product), candidates[product][0],
                                          results[0]["config"], results))
    finally:
        if bar is not None:
            bar.close()
    result = AutotuningResult(op.family, _device_kind(), measured, _metadata(),
                              untuned={p: bound.heuristic_config(p) for p in op.products if p not in products})
    if write_cache:
        cache = ConfigCache(op.family, result.device_kind, op.config_cls)
        path = cache.record({canonical_key(p.key): {"results": p.results, "metadata": result.metadata}
                             for p in measured})
        result.cache_path = None if path is None else str(path)
    return result
