"""The op base class (binding a call once), the op registry and the op table built from it."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import tokamax_torch
from tokamax_torch import _op, _registry
from tokamax_torch.autotuning import cache as cache_mod
from tokamax_torch.autotuning import cli
from tokamax_torch.ops import dot_product_attention as dpa
from tokamax_torch.ops import ragged_dot as rd

REPO = pathlib.Path(__file__).resolve().parent.parent
META = dict(device="meta")


def ragged_args(m=96, k=64, n=48, g=3):
    return torch.randn(m, k), torch.randn(g, k, n), torch.full((g,), m // g, dtype=torch.int32)


def attention_args(b=1, t=16, s=24, n=4, kv=2, h=8):
    return torch.randn(b, t, n, h), torch.randn(b, s, kv, h), torch.randn(b, s, kv, h)


# ---- the registry -------------------------------------------------------------------------------

def test_every_op_module_is_registered_and_exported():
    modules = sorted(p.stem for p in (REPO / "tokamax_torch" / "ops").glob("*.py") if not p.stem.startswith("_"))
    assert list(_registry.families()) == modules == sorted(tokamax_torch.ops.__all__)
    for name, family in _registry.families().items():
        module = getattr(tokamax_torch.ops, name)
        assert family.kernel is module.kernel and family.reference is module.reference
        assert getattr(tokamax_torch, name) is module.kernel and name in tokamax_torch.__all__
        assert family.kernel.family == family.reference.family == name
        assert family.kernel.tunable == (family.kernel.config_cls is not None) and not family.reference.tunable


def test_a_second_singleton_of_a_family_is_an_error(monkeypatch):
    monkeypatch.setattr(_registry, "_FAMILIES", dict(_registry._FAMILIES))
    with pytest.raises(ValueError, match="'ragged_dot' already has a kernel singleton"):
        type(rd.kernel)("kernel", rd.kernel.op)
    with pytest.raises(ValueError, match=r"name must be one of \('reference', 'kernel'\), got 'fast'"):
        type(rd.kernel)("fast", rd.kernel.op)
    with pytest.raises(KeyError, match="no op family 'matmul'; known: "):
        _registry.family("matmul")


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    block: int

    def to_list(self):
        return [self.block]


class _Toy(_op.Op):
    """An op written in Python, as a new op would be written through the kit: a signature, its
    canonical form, its products and configs, and its command line. Nothing else is edited."""

    family = "toy_scale"
    product_specs = (_op.Product("forward", 0), _op.Product("backward", 1, wrt=("x",)))
    config_cls = ToyConfig
    summary = "A toy op of the registry tests."
    cli_shape = "N"

    def __call__(self, x, *, factor=2.0, configs=None):
        self._split_configs(configs)
        return x * factor

    def canonicalize(self, arguments):
        arguments["factor"] = float(arguments["factor"])
        return arguments

    def heuristic_config_values(self, bound, product_id):
        return [16] if product_id == 0 else [8]

    def config_space_values(self, bound, product_id):
        return [16, 32, 64] if product_id == 0 else [8, 4]

    def add_cli_arguments(self, parser):
        parser.add_argument("--factor", type=float, default=2.0)

    def cli_call(self, shape, dtype, options):
        return self.bind(torch.empty(int(shape), dtype=dtype, device="meta"), factor=options.factor)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(_registry, "_FAMILIES", dict(_registry._FAMILIES))
    _Toy("reference", None)
    return _Toy("kernel", None)


def test_a_new_op_is_tuned_looked_up_listed_and_on_the_command_line(toy, capsys):
    assert _registry.family("toy_scale").kernel is toy
    assert "| `toy_scale` | `forward`, `backward` | A toy op of the registry tests. |" in _registry.op_table()
    x = torch.randn(64)
    assert tokamax_torch.get_configs(toy, x) == (ToyConfig(16), ToyConfig(8))
    result = tokamax_torch.autotune(toy, x, factor=3, reps=1, progress=False)
    assert [len(p.results) for p in result.products] == [3, 2]
    assert result.products[1].key == {"x": {"shape": [64], "dtype": "float32"}, "factor": 3.0, "product": "backward"}
    # factor=3 and factor=3.0 are one call: the lookup finds what was tuned.
    tokamax_torch.config.autotuning_cache_miss = "error"
    assert tokamax_torch.get_configs(toy, x, factor=3.0, from_autotuning_cache=True) == result.configs
    assert cli.main(["toy_scale", "--shape", "32", "--factor", "0.5", "--reps", "1", "--no-write"]) == 0
    assert "autotuning toy_scale" in capsys.readouterr().out


class _ForwardOnlyToy(_Toy):
    family = "toy_forward_only"
    product_specs = (_op.Product("forward", 0),)


def test_configs_of_ops_with_none_one_or_several_backward_products(toy):
    forward_only = _ForwardOnlyToy("kernel", None)
    x = torch.randn(8)
    assert tokamax_torch.get_configs(forward_only, x) == (ToyConfig(16), None)
    assert forward_only.split_configs((ToyConfig(32), None)) == {"forward": ToyConfig(32)}
    assert toy.split_configs(toy.assemble_configs({"forward": ToyConfig(1), "backward": ToyConfig(2)})) == {
        "forward": ToyConfig(1), "backward": ToyConfig(2)}
    ragged = {"forward": rd.Config(12, 64, 32, 24, 0), "dlhs": rd.Config(6, 32, 16, 6, 0),
              "drhs": rd.Config(12, 128, 32, 12, 96)}
    fwd, bwd = rd.kernel.assemble_configs(ragged)
    assert isinstance(bwd, rd.BackwardConfig) and bwd.drhs == ragged["drhs"]
    assert rd.kernel.split_configs((fwd, bwd)) == ragged


# ---- binding ------------------------------------------------------------------------------------

def test_equal_calls_bind_to_equal_arguments():
    lhs, rhs, gs = (t.to("meta") for t in ragged_args())
    spellings = [
        rd.kernel.bind(lhs, rhs, gs),
        rd.kernel.bind(lhs=lhs, rhs=rhs, group_sizes=gs, configs=((12, 64, 32, 24, 0), None)),
        rd.kernel.bind(lhs, rhs, gs, ragged_dot_dimension_numbers=rd.DEFAULT),
        rd.kernel.bind(lhs, rhs, gs, ragged_dot_dimension_numbers=rd.DEFAULT.flatten(), preferred_element_type=None),
    ]
    for bound in spellings:
        assert list(bound.arguments) == ["lhs", "rhs", "group_sizes", "ragged_dot_dimension_numbers",
                                         "preferred_element_type"]
        assert bound.cache_key("dlhs") == spellings[0].cache_key("dlhs")
    typed = rd.kernel.bind(lhs, rhs, gs, preferred_element_type="bfloat16")
    assert typed["preferred_element_type"] is torch.bfloat16
    assert typed.cache_key()["preferred_element_type"] == "bfloat16"
    q, k, v = (t.to("meta") for t in attention_args())
    a = dpa.kernel.bind(q, k, v, None, None, is_causal=1, local_window_size=4, logits_soft_cap=30)
    b = dpa.kernel.bind(q, key=k, value=v, is_causal=True, local_window_size=(4, 4), logits_soft_cap=30.0, scale=0.5)
    assert a["local_window_size"] == (4, 4) and a["is_causal"] is True and a["logits_soft_cap"] == 30.0
    assert a.cache_key("backward") == b.cache_key("backward")  # the scale does not change the work
    assert a.cache_key()["local_window_size"] == [4, 4] and a.cache_key()["logits_soft_cap"] is True


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_wrong_typed_scalars_raise_type_errors_naming_the_argument(impl):
    # A float where an int is meant is not truncated (sliding_window=2.7 once ran as 2), a string
    # is not a truthy flag ("False"), a bool is not a count (router_topk(s, True) once meant k=1):
    # each is a TypeError naming the op and the argument, raised before any tensor is read.
    from tokamax_torch.ops import (fused_moe, gated_linear_unit, layer_norm,
                                   linear_softmax_cross_entropy_loss, ragged_paged_attention, router_topk, topk)
    x = torch.zeros(2, 4)
    cases = [
        (ragged_paged_attention, lambda op: op(*([x] * 8), sliding_window=2.7),
         "ragged_paged_attention: sliding_window must be an int or None, got 2.7"),
        (ragged_paged_attention, lambda op: op(*([x] * 8), use_causal_mask="no"),
         "ragged_paged_attention: use_causal_mask must be a bool, got 'no'"),
        (ragged_paged_attention, lambda op: op(*([x] * 8), soft_cap="3"),
         "ragged_paged_attention: soft_cap must be a number or None, got '3'"),
        (dpa, lambda op: op(x, x, x, is_causal="False"), "dot_product_attention: is_causal must be a bool, got 'False'"),
        (dpa, lambda op: op(x, x, x, scale=True), "dot_product_attention: scale must be a number or None, got True"),
        (layer_norm, lambda op: op(x, axis=-1.0), "layer_norm: axis must be an int, got -1.0"),
        (layer_norm, lambda op: op(x, subtract_mean="False"), "layer_norm: subtract_mean must be a bool, got 'False'"),
        (linear_softmax_cross_entropy_loss, lambda op: op(x, x, x, ignore_index=2.5),
         "linear_softmax_cross_entropy_loss: ignore_index must be an int, got 2.5"),
        (topk, lambda op: op(x, 1, return_scores="no"), "topk: return_scores must be a bool, got 'no'"),
        (topk, lambda op: op(x, 1.5), "topk: k must be an int, got 1.5"),
        (router_topk, lambda op: op(x, True), "router_topk: k must be an int, got True"),
        (fused_moe, lambda op: op(x, x, x, x, topk=1.7), "fused_moe: topk must be an int, got 1.7"),
        (fused_moe, lambda op: op(x, x, x, x, topk=1, renormalize="yes"),
         "fused_moe: renormalize must be a bool, got 'yes'"),
        (gated_linear_unit, lambda op: op(x, (x, x), return_residuals="no"),
         "gated_linear_unit: return_residuals must be a bool, got 'no'"),
    ]
    for module, call, message in cases:
        with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            call(getattr(module, impl))
    # What is accepted: ints for floats, 0 and 1 for flags, numpy scalars (bound, not run).
    import numpy as np
    bound = dpa.kernel.bind(*attention_args(), is_causal=np.bool_(True), scale=np.float32(0.5),
                            local_window_size=None, return_residuals=0)
    assert bound["is_causal"] is True and bound["scale"] == 0.5 and bound["return_residuals"] is False


def test_binding_errors_name_the_op_and_the_argument():
    lhs, rhs, gs = ragged_args()
    with pytest.raises(TypeError, match="ragged_dot: missing a required argument: 'group_sizes'"):
        rd.kernel.bind(lhs, rhs)
    with pytest.raises(TypeError, match="ragged_dot: got an unexpected keyword argument 'dimension_numbers'"):
        rd.kernel.get_configs(lhs, rhs, gs, dimension_numbers=rd.DEFAULT)
    with pytest.raises(TypeError, match="preferred_element_type must be a torch.dtype"):
        rd.kernel.bind(lhs, rhs, gs, preferred_element_type=3)
    with pytest.raises(TypeError, match="local_window_size must be an int"):
        dpa.kernel.bind(*attention_args(), local_window_size="wide")
    with pytest.raises(ValueError, match=r"ragged_dot: product must be one of \['forward', 'dlhs', 'drhs'\], got 'bw"):
        rd.kernel.bind(lhs, rhs, gs).cache_key("bwd")
    with pytest.raises(TypeError, match="BoundArguments already hold the call's arguments"):
        tokamax_torch.get_configs(rd.kernel.bind(lhs, rhs, gs), lhs)


def test_bound_arguments_drive_configs_calls_and_tuning():
    args = ragged_args()
    bound = rd.kernel.bind(*args)
    assert tokamax_torch.get_configs(bound) == rd.kernel.get_configs(*args)
    assert tokamax_torch.get_configs(bound) == tokamax_torch.get_configs(rd.kernel, *args)
    fwd, bwd = bound.heuristic_configs()
    assert fwd == bound.config_space("forward")[0] and bwd.drhs == bound.config_space("drhs")[0]
    assert torch.equal(bound(configs=(fwd, bwd)), tokamax_torch.ragged_dot(*args))
    assert rd.reference.bind(*args).heuristic_configs() == (None, None)
    result = tokamax_torch.autotune(bound, products=["forward"], max_configs=2, reps=1, progress=False)
    assert result.products[0].key == bound.cache_key("forward")


def test_the_runner_makes_real_inputs_for_meta_arguments():
    q, k, v = (t.to("meta") for t in attention_args(t=5, s=7))
    lengths = torch.empty(1, dtype=torch.int32, device="meta")
    bound = dpa.kernel.bind(q, k, v, mask=torch.empty(1, 1, 5, 7, dtype=torch.bool, device="meta"),
                            query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    seen = {}
    generator = torch.Generator().manual_seed(0)
    for name, value in bound.arguments.items():
        seen[name] = dpa.kernel.real_argument(bound, name, value, generator)
    assert seen["query_seq_lengths"].tolist() == [5] and seen["key_value_seq_lengths"].tolist() == [7]
    assert seen["mask"].all() and seen["query"].device.type == "cpu" and seen["query"].std() > 0
    for product in dpa.kernel.products:
        bound.autotuning_runner(product)(bound.heuristic_config(product))  # runs without error
    sizes = rd.kernel.bind(*(t.to("meta") for t in ragged_args(m=10, g=3)))
    assert rd.kernel.real_argument(sizes, "group_sizes", sizes["group_sizes"], generator).tolist() == [3, 3, 3]


def test_shipped_cache_keys_are_what_binding_their_arguments_gives():
    # Lookups compare keys exactly, so a key written by an older version must still be what
    # binding the same call gives now.
    files = sorted(cache_mod.SHIPPED_ROOT.glob("*/ragged_dot.json"))
    assert files
    for path in files:
        for text in json.loads(path.read_text())["entries"]:
            key = json.loads(text)
            lhs, rhs = (torch.empty(key[n]["shape"], dtype=getattr(torch, key[n]["dtype"]), **META)
                        for n in ("lhs", "rhs"))
            gs = key["group_sizes"]
            sizes = (gs["values"] if "values" in gs
                     else torch.empty(gs["shape"], dtype=getattr(torch, gs["dtype"]), **META))
            bound = rd.kernel.bind(lhs, rhs, sizes, ragged_dot_dimension_numbers=key["ragged_dot_dimension_numbers"],
                                   preferred_element_type=key["preferred_element_type"])
            assert bound.cache_key(key["product"]) == key, path


# ---- the op table -------------------------------------------------------------------------------

def test_the_readme_op_table_is_the_registrys():
    code = subprocess.run([sys.executable, str(REPO / "scripts" / "op_table.py"), "--check", str(REPO / "README.md")],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert code.returncode == 0, code.stderr
    readme = (REPO / "README.md").read_text()
    assert _registry.op_table() in readme
    for name in _registry.families():
        assert f"| `{name}` |" in readme


def test_the_op_table_check_fails_on_a_stale_table(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text((REPO / "README.md").read_text().replace("| `ragged_dot` |", "| `ragged_dot_v0` |"))
    script = [sys.executable, str(REPO / "scripts" / "op_table.py")]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    check = subprocess.run([*script, "--check", str(stale)], capture_output=True, text=True, env=env)
    assert check.returncode == 1 and "op table differs" in check.stderr
    subprocess.run([*script, "--write", str(stale)], check=True, env=env)
    assert stale.read_text() == (REPO / "README.md").read_text()
    printed = subprocess.run(script, capture_output=True, text=True, env=env, check=True).stdout
    assert printed == _registry.op_table()
