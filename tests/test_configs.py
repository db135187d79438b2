"""The config mechanism: Config classes built from the C++ field lists, for every op."""

import dataclasses
import json
import pathlib
import pickle
import re
import warnings

import pytest
import torch

import tokamax_torch
from tokamax_torch import configs as _configs
from tokamax_torch.autotuning import cache as cache_mod
from tokamax_torch.ops import dot_product_attention as dpa
from tokamax_torch.ops import ragged_dot as rd


def ragged_dot_args():
    return (torch.randn(64, 32), torch.randn(4, 32, 48), torch.tensor([16, 16, 16, 16], dtype=torch.int32))


def attention_args():
    return (torch.randn(1, 40, 4, 16), torch.randn(1, 56, 2, 16), torch.randn(1, 56, 2, 16))


# (op name, its module, sample arguments of the config helper ops, the products it must declare)
OPS = [
    pytest.param("ragged_dot", rd, ragged_dot_args, ("forward", "dlhs", "drhs"), id="ragged_dot"),
    pytest.param("dot_product_attention", dpa, attention_args, ("forward", "backward"), id="dot_product_attention"),
]


def bounds(op):
    """{field: (min, max, multiple_of)} read from the descriptions the library reports."""
    names, docs, _ = _configs._describe(op)
    out = {}
    for name, doc in zip(names, docs):
        m = re.search(r"\((?:a multiple of (\d+) )?in \[(-?\d+), (-?\d+)\]\)$", doc)
        assert m, doc
        out[name] = (int(m.group(2)), int(m.group(3)), int(m.group(1) or 1))
    return out


def heuristic(op, module, args, product="forward"):
    return module.Config.from_list(
        getattr(torch.ops.tokamax, f"_{op}_heuristic_config")(*args(), product=module.PRODUCTS[product]))


@pytest.mark.parametrize("op, module, args, products", OPS)
def test_products_come_from_cpp_in_order(op, module, args, products):
    assert tuple(module.PRODUCTS) == products
    assert list(module.PRODUCTS.values()) == list(range(len(products)))
    assert module.kernel.products == products
    listed = [f"{i} ({name})" for i, name in enumerate(products)]
    expected = f"{op}: product must be {', '.join(listed[:-1])} or {listed[-1]}, got 7"
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        getattr(torch.ops.tokamax, f"_{op}_heuristic_config")(*args(), product=7)


@pytest.mark.parametrize("op, module, args, products", OPS)
def test_fields_in_cpp_order_with_descriptions(op, module, args, products):
    names = [f.name for f in dataclasses.fields(module.Config)]
    assert names == list(bounds(op))
    assert all(f.type in (int, "int") for f in dataclasses.fields(module.Config))
    for name in names:  # the C++ descriptions reach the docstring
        assert f"    {name}: " in module.Config.__doc__


@pytest.mark.parametrize("op, module, args, products", OPS)
def test_round_trip(op, module, args, products):
    for product in products:
        config = heuristic(op, module, args, product)
        values = config.to_list()
        assert all(type(v) is int for v in values)
        assert module.Config.from_list(values) == config
        assert module.Config(*values) == config
        assert module.Config(**dataclasses.asdict(config)) == config
        # The int[] the schema carries is accepted as the config itself.
        assert _configs.config_to_list(config) == values
        # As the autotuning cache stores it: a JSON object keyed by field name.
        assert module.Config(**json.loads(json.dumps(dataclasses.asdict(config)))) == config
        assert pickle.loads(pickle.dumps(config)) == config
    assert type(pickle.loads(pickle.dumps(config))) is module.Config


@pytest.mark.parametrize("op, module, args, products", OPS)
def test_equality_hash_and_repr(op, module, args, products):
    config = heuristic(op, module, args)
    same = module.Config.from_list(config.to_list())
    assert config == same and hash(config) == hash(same)
    assert len({config, same}) == 1
    fields = [f.name for f in dataclasses.fields(module.Config)]
    assert repr(config) == "Config(" + ", ".join(f"{n}={getattr(config, n)}" for n in fields) + ")"
    assert module.Config.__module__ == module.__name__ and module.Config.__qualname__ == "Config"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, fields[0], 1)
    # Every field takes part in equality: change each (to another valid value) in turn.
    limits = bounds(op)
    for i, name in enumerate(fields):
        values = config.to_list()
        low, high, step = limits[name]
        for candidate in (values[i] + step, values[i] - step, 2 * values[i], low, high):
            values[i] = candidate
            try:
                other = module.Config.from_list(values)
            except RuntimeError:  # a cross-field rule: try the next candidate
                continue
            assert other != config
            break
        else:
            pytest.fail(f"no valid value of {name} other than {config}")


@pytest.mark.parametrize("op, module, args, products", OPS)
def test_bounds_errors_name_the_field_the_range_and_the_value(op, module, args, products):
    config = heuristic(op, module, args)
    for i, (name, (low, high, step)) in enumerate(bounds(op).items()):
        range_text = (f"a multiple of {step} " if step > 1 else "") + f"in \\[{low}, {high}\\]"
        bad_values = [low - 1, high + 1] + ([low + 1] if step > 1 else [])
        for bad in bad_values:
            values = config.to_list()
            values[i] = bad
            expected = f"{op} config: {name} must be {range_text}, got {bad}"
            with pytest.raises(RuntimeError, match=expected):
                module.Config.from_list(values)
            with pytest.raises(RuntimeError, match=expected):
                module.Config(**dict(zip(bounds(op), values)))
            with pytest.raises(RuntimeError, match=expected):
                getattr(torch.ops.tokamax, f"_{op}_validate_config")(values)


@pytest.mark.parametrize("op, module, args, products", OPS)
def test_unknown_missing_and_non_int_fields_rejected(op, module, args, products):
    config = heuristic(op, module, args)
    fields = dataclasses.asdict(config)
    first = next(iter(fields))
    with pytest.raises(TypeError, match="bogus"):
        module.Config(**fields, bogus=1)
    missing = dict(fields)
    del missing[first]
    with pytest.raises(TypeError, match=first):
        module.Config(**missing)
    with pytest.raises(ValueError, match=f"{op} config: expected {len(fields)} values \\({', '.join(fields)}\\), got 1"):
        module.Config.from_list([1])
    with pytest.raises(ValueError, match=f"expected {len(fields)} values"):
        module.Config.from_list(config.to_list() + [1])
    for bad in (1.0, True, "8", None):
        with pytest.raises(TypeError, match=f"Config.{first} must be an int, got {type(bad).__name__}"):
            module.Config(**{**fields, first: bad})
    # The raw int[] path of the op counts values too.
    with pytest.raises(RuntimeError, match=f"expected {len(fields)} values"):
        getattr(torch.ops.tokamax, f"_{op}_validate_config")(config.to_list()[:-1])


@pytest.mark.parametrize("op, module, args, products", OPS)
def test_heuristic_of_each_product_heads_its_search_space(op, module, args, products):
    for product in products:
        space = module.kernel.config_space(*args(), product=product)
        assert space and all(type(c) is module.Config for c in space)
        assert space[0] == heuristic(op, module, args, product)
        assert len(set(space)) == len(space)  # hashable, and no candidate twice


@pytest.mark.parametrize("op, module, args, products", OPS)
def test_config_helper_ops_need_concrete_shapes(op, module, args, products):
    # One helper (csrc/torch/op_kit.h) serves every op: traced with symbolic sizes, both
    # helper ops say why they cannot answer.
    for name in ("heuristic_config", "config_space"):
        helper = getattr(torch.ops.tokamax, f"_{op}_{name}")
        compiled = torch.compile(lambda *xs, helper=helper: torch.tensor(helper(*xs)), dynamic=True, fullgraph=True)
        with pytest.raises(Exception, match="configs are chosen for concrete shapes"):
            compiled(*args())


def test_shipped_cache_files_load_with_the_derived_classes():
    root = pathlib.Path(cache_mod.SHIPPED_ROOT)
    files = sorted(root.glob("*/*.json"))
    assert files, root
    ops = {"ragged_dot": rd.Config, "dot_product_attention": dpa.Config}
    for path in files:
        config_cls = ops[path.stem]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            entries = cache_mod.parse_file(path.read_text(), path.stem, path.parent.name, config_cls)
        assert entries
        for entry in entries.values():
            assert all(type(r["config"]) is config_cls for r in entry["results"])


def test_get_configs_returns_the_derived_classes():
    fwd, bwd = tokamax_torch.get_configs(rd.kernel, *ragged_dot_args())
    assert type(fwd) is rd.Config and type(bwd.dlhs) is rd.Config and type(bwd.drhs) is rd.Config
    assert bwd.to_list() == bwd.dlhs.to_list() + bwd.drhs.to_list()
    fwd, bwd = tokamax_torch.get_configs(dpa.kernel, *attention_args())
    assert type(fwd) is dpa.Config and type(bwd) is dpa.Config
