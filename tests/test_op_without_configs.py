"""The kit with an op that has no configs (as kv_cache_update will be): a test-only op, made here
with torch.library and registered in the op registry for the test's scope only."""

import pytest
import torch

import tokamax_torch
import test_op_contract as suite
from contract import BadInput, DynamicSizes, OpContract, Sample
from tokamax_torch import _op, _registry


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise RuntimeError(f"twice_rows: x must be 2-D, got shape {list(x.shape)}")


@torch.library.custom_op("tokamax_test::twice_rows", mutates_args=())
def _twice_rows(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    return x * 2


@_twice_rows.register_fake
def _(x):
    _check(x)
    return torch.empty_like(x)


_twice_rows.register_autograd(lambda ctx, grad: grad * 2)


class _TwiceRows(_op.Op):
    """No product_specs, no config_cls: the op has no configs."""

    family = "twice_rows"
    summary = "Test-only: twice its input."

    def __call__(self, x):
        return self._op(x)


def _sample(rows=5, cols=7, grad=True):
    return lambda: ((torch.randn(rows, cols, requires_grad=grad),), {})


def _contract(reference, kernel):
    return OpContract(
        name="twice_rows", reference=reference, kernel=kernel,
        samples=[Sample("small", _sample()), Sample("no-grad", _sample(grad=False), compile=False)],
        bad_inputs=lambda: [BadInput("x must be 2-D", (torch.randn(3),))],
        dynamic=[DynamicSizes("rows-cols", lambda r, c: ((torch.randn(r, c),), {}),
                              sizes=[{"r": 5, "c": 7}, {"r": 9, "c": 11}, {"r": 13, "c": 17}],
                              dims={"r": (2, 64), "c": (2, 64)}, dynamic_shapes=lambda d: ({0: d["r"], 1: d["c"]},))],
        determinism_samples=[Sample("large", _sample(300, 257))])


@pytest.fixture
def twice_rows(monkeypatch):
    """The op's singletons, registered until the test ends."""
    monkeypatch.setattr(_registry, "_FAMILIES", dict(_registry._FAMILIES))
    op = torch.ops.tokamax_test.twice_rows.default
    return _contract(_TwiceRows("reference", op), _TwiceRows("kernel", op))


def test_an_op_without_configs_registers_and_is_not_tunable(twice_rows):
    assert _registry.family("twice_rows").kernel is twice_rows.kernel
    assert not twice_rows.kernel.tunable and twice_rows.kernel.products == ()
    assert "twice_rows" not in _registry.tunable_families()
    assert "| `twice_rows` | none | Test-only: twice its input. |" in _registry.op_table()


def test_get_configs_and_autotune_handle_an_op_without_configs(twice_rows):
    x = torch.randn(4, 3)
    for impl in twice_rows.implementations:
        assert tokamax_torch.get_configs(impl, x) == (None, None)
        assert tokamax_torch.get_configs(impl, x, from_autotuning_cache=True) == (None, None)
        for query in (impl.config_space, impl.cache_key):
            with pytest.raises(ValueError, match="twice_rows: the op has no configs"):
                query(x)
    with pytest.raises(ValueError, match="has no configs to tune"):
        tokamax_torch.autotune(twice_rows.kernel, x)


def test_products_and_a_config_class_are_declared_together(twice_rows):
    class _Half(_TwiceRows):
        product_specs = (_op.Product("forward", 0),)

    with pytest.raises(TypeError, match="product_specs and config_cls are declared together"):
        _Half("kernel", twice_rows.kernel.op)


def _run(param):
    """Runs one case of the shared suite; False when the suite marks it skipped."""
    return not any(mark.name == "skip" for mark in param.marks)


CONFIG_CHECKS = {"_kernel_samples": suite.test_no_config_is_the_heuristic_config,
                 "_products": suite.test_config_space_starts_with_the_heuristic_config,
                 "_invalid_configs": suite.test_invalid_configs_rejected}


def test_the_contract_suite_skips_only_the_config_checks(twice_rows):
    contracts = [twice_rows]
    for builder in CONFIG_CHECKS:
        params = getattr(suite, builder)(contracts=contracts)
        assert len(params) == 1 and not _run(params[0]), builder
        assert params[0].marks[0].kwargs["reason"] == "twice_rows has no configs: config checks do not apply"
    # Every other check runs, and passes, for the op.
    checks = [(suite._impl_samples(contracts=contracts), suite.test_opcheck),
              (suite._impl_samples(compiled=True, contracts=contracts), suite.test_compile_fullgraph_matches_eager),
              (suite._impl_dynamic(compiled=True, contracts=contracts), suite.test_compile_dynamic_is_one_graph),
              (suite._impl_dynamic(contracts=contracts), suite.test_export_with_dynamic_dims),
              (suite._bad_inputs(contracts=contracts), suite.test_bad_input_raises_before_compute),
              (suite._bad_inputs(contracts=contracts), suite.test_bad_input_raises_under_compile)]
    for params, check in checks:
        assert params and all(_run(p) for p in params), check.__name__
        for param in params:
            check(*param.values)
    for param in suite._determinism_samples(contracts=contracts):
        suite.test_kernel_bitwise_deterministic_across_runs_and_threads(*param.values, num_threads=3)
