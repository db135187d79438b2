"""The autotuning cache and the autotuner (issue 3)."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import tokamax_torch
from tokamax_torch.autotuning import cache as cache_mod
from tokamax_torch.ops import ragged_dot as rd

REPO = pathlib.Path(__file__).resolve().parent.parent


def small_args(m=96, k=64, n=48, g=3, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.randn(m, k, dtype=dtype), torch.randn(g, k, n, dtype=dtype), torch.full((g,), m // g, dtype=torch.int32)


def user_file():
    return pathlib.Path(tokamax_torch.config.cache_dir) / "autotuning" / tokamax_torch.device_kind() / "ragged_dot.json"


def tune(*args, **kwargs):
    kwargs.setdefault("max_configs", 4)
    kwargs.setdefault("reps", 2)
    kwargs.setdefault("progress", False)
    return tokamax_torch.autotune(tokamax_torch.ragged_dot, *args, **kwargs)


# ---- device_kind --------------------------------------------------------------------------------

def test_device_kind_is_normalised_and_stable():
    kind = tokamax_torch.device_kind()
    vendor, *_, isa = kind.split("_")
    assert kind == kind.lower() and all(part.isalnum() for part in kind.split("_"))
    assert vendor in ("amd", "intel", "arm", "unknown") and isa in ("scalar", "avx2", "avx512", "avx512bf16", "amx")
    assert tokamax_torch.device_kind() == tokamax_torch.device_kind(torch.device("cpu")) == kind
    with pytest.raises(NotImplementedError, match="only CPU"):
        tokamax_torch.device_kind("meta")


def test_device_kind_follows_the_forced_tier(monkeypatch):
    monkeypatch.setenv("TOKAMAX_CPU_ISA", "scalar")
    assert tokamax_torch.device_kind().endswith("_scalar")


# ---- autotune, the result, the cache ------------------------------------------------------------

def test_autotune_writes_cache_and_get_configs_reads_it():
    lhs, rhs, gs = small_args()
    result = tune(lhs, rhs, gs)
    assert [p.product for p in result.products] == ["forward", "dlhs", "drhs"]
    for p in result.products:
        assert p.results[0]["config"] == p.best and p.timing(p.heuristic) is not None
        assert all(r["samples"] == 2 and r["min_ms"] <= r["median_ms"] for r in p.results)
    assert result.cache_path == str(user_file())
    data = json.loads(user_file().read_text())
    assert data["format"] == cache_mod.FORMAT and len(data["entries"]) == 3
    for entry in data["entries"].values():
        assert set(entry["metadata"]) == {"tokamax_torch", "torch", "date"}
    fwd, bwd = tokamax_torch.get_configs(tokamax_torch.ragged_dot, lhs, rhs, gs, from_autotuning_cache=True)
    assert (fwd, bwd) == result.configs
    # Lookups work on meta tensors and need no tuning.
    meta = [t.to("meta") for t in (lhs, rhs, gs)]
    assert tokamax_torch.get_configs(tokamax_torch.ragged_dot, *meta, from_autotuning_cache=True) == result.configs
    # The reference has no configs, cache or not.
    assert tokamax_torch.get_configs(rd.reference, lhs, rhs, gs, from_autotuning_cache=True) == (None, None)


def test_result_prints_a_table_and_round_trips():
    result = tune(*small_args(), products=["forward"])
    text = str(result)
    assert "heuristic ms" in text and "best ms" in text and "forward" in text
    again = tokamax_torch.AutotuningResult.loads(result.dumps())
    assert again == result and again.products[0].best == result.products[0].best


def test_budget_and_products(monkeypatch):
    result = tune(*small_args(), products=["drhs"], budget_s=0.0, max_configs=None)
    (p,) = result.products
    assert p.product == "drhs" and len(p.results) == 1 and p.best == p.heuristic  # heuristic always timed
    with pytest.raises(ValueError, match="product must be one of"):
        tune(*small_args(), products=["backward"])
    with pytest.raises(ValueError, match="no configs to tune"):
        tokamax_torch.autotune(rd.reference, *small_args())
    with pytest.raises(ValueError, match="reps must be >= 1"):
        tune(*small_args(), reps=0)


def test_representative_group_sizes_make_their_own_key():
    lhs, rhs, _ = small_args()
    tune(lhs, rhs, [10, 50, 36], products=["forward"])
    keys = [json.loads(k) for k in json.loads(user_file().read_text())["entries"]]
    assert keys[0]["group_sizes"] == {"values": [10, 50, 36]}
    # A lookup by shape does not match a key with values: it falls back to the heuristic.
    by_shape = tokamax_torch.get_configs(tokamax_torch.ragged_dot, *small_args(), from_autotuning_cache=True)
    assert by_shape == tokamax_torch.get_configs(tokamax_torch.ragged_dot, *small_args())


@pytest.mark.parametrize("sizes", [[10, 50.7, 36], [10, True, 36], [10, "50", 36]])
def test_representative_group_sizes_must_be_ints(sizes):
    lhs, rhs, _ = small_args()
    with pytest.raises(TypeError, match=r"ragged_dot: group_sizes\[1\] must be an int"):
        tokamax_torch.get_configs(tokamax_torch.ragged_dot, lhs, rhs, sizes)


def test_meta_tensors_with_representative_group_sizes():
    lhs, rhs, _ = (t.to("meta") for t in small_args())
    sizes = [10, 50, 36]
    assert len(rd.kernel.config_space(lhs, rhs, sizes)) > 1
    result = tune(lhs, rhs, sizes, products=["forward"])
    assert tokamax_torch.get_configs(tokamax_torch.ragged_dot, lhs, rhs, sizes, from_autotuning_cache=True)[0] \
        == result.products[0].best


def test_meta_tensors_can_be_autotuned():
    lhs, rhs, gs = (t.to("meta") for t in small_args())
    result = tune(lhs, rhs, gs, products=["forward"])
    assert result.products[0].key["lhs"] == {"shape": [96, 64], "dtype": "float32"}


def test_tuned_config_is_deterministic_and_agrees_with_heuristic():
    lhs, rhs, gs = small_args(m=120, k=300, n=80)
    tune(lhs, rhs, gs, max_configs=8)
    configs = tokamax_torch.get_configs(tokamax_torch.ragged_dot, lhs, rhs, gs, from_autotuning_cache=True)
    tuned = tokamax_torch.ragged_dot(lhs, rhs, gs, configs=configs)
    assert torch.equal(tuned, tokamax_torch.ragged_dot(lhs, rhs, gs, configs=configs))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = tokamax_torch.ragged_dot(lhs, rhs, gs, configs=configs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(tuned, single)
    torch.testing.assert_close(tuned, tokamax_torch.ragged_dot(lhs, rhs, gs), rtol=2e-5, atol=2e-5)


# ---- misses -------------------------------------------------------------------------------------

def test_miss_falls_back_warns_or_raises(monkeypatch):
    args = small_args()
    heuristic = tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args)
    assert tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args, from_autotuning_cache=True) == heuristic
    monkeypatch.setattr(tokamax_torch.config, "autotuning_cache_miss", "warn")
    with pytest.warns(RuntimeWarning, match="no autotuned ragged_dot config for 3 of 3 products"):
        assert tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args, from_autotuning_cache=True) == heuristic
    monkeypatch.setattr(tokamax_torch.config, "autotuning_cache_miss", "error")
    with pytest.raises(LookupError, match="no autotuned ragged_dot config"):
        tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args, from_autotuning_cache=True)
    with pytest.raises(ValueError, match="autotuning_cache_miss must be one of"):
        tokamax_torch.config.autotuning_cache_miss = "sometimes"


def test_settings_come_from_the_environment():
    code = ("import tokamax_torch as t; print(t.config.autotuning_cache_miss, t.config.cache_dir)")
    env = dict(os.environ, TOKAMAX_TORCH_AUTOTUNING_CACHE_MISS="error", TOKAMAX_TORCH_CACHE_DIR="/tmp/x-cache")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["error", "/tmp/x-cache"]


# ---- robustness ---------------------------------------------------------------------------------

def _entry(config, key=None):
    lhs, rhs, gs = small_args()
    key = key or rd.kernel.cache_key(lhs, rhs, gs, product="forward")
    return {cache_mod.canonical_key(key): {"results": [{"config": config, "median_ms": 1.0, "min_ms": 0.9,
                                                         "samples": 3}], "metadata": {}}}


def _file(entries=None, **overrides):
    doc = {"format": cache_mod.FORMAT, "op": "ragged_dot", "device_kind": tokamax_torch.device_kind(),
           "entries": entries if entries is not None else {}}
    doc.update(overrides)
    return json.dumps(doc)


GOOD = {"block_m": 12, "block_k": 64, "block_n": 32, "task_m": 24, "pack_b_min_rows": 0}
BAD_FILES = {
    "corrupt": "{not json",
    "truncated": _file(_entry(GOOD))[:-40],
    "wrong top-level type": "[1, 2, 3]",
    "wrongly typed config": _file(_entry(dict(GOOD, block_m="12"))),
    "missing field": _file(_entry({k: v for k, v in GOOD.items() if k != "task_m"})),
    "foreign version": _file(_entry(GOOD), format="tokamax_torch.autotuning/99"),
    "other device kind": _file(_entry(GOOD), device_kind="amd_zen9_avx1024"),
    "tile size 0": _file(_entry(dict(GOOD, block_m=0))),
    "tile size 1e9": _file(_entry(dict(GOOD, block_n=10**9))),
    "negative timing": _file({k: dict(v, results=[dict(v["results"][0], median_ms=-1)]) for k, v in _entry(GOOD).items()}),
    "infinite timing": _file(_entry(GOOD)).replace('"median_ms": 1.0', '"median_ms": Infinity'),
    "NaN timing": _file(_entry(GOOD)).replace('"min_ms": 0.9', '"min_ms": NaN'),
    "overflowing timing": _file(_entry(GOOD)).replace('"median_ms": 1.0', '"median_ms": 1e400'),
    "a member twice": _file(_entry(GOOD)).replace('"op": "ragged_dot"', '"op": "ragged_dot", "op": "ragged_dot"'),
    "one key spelt twice": _file({**_entry(GOOD), **{k.replace(",", ", "): v for k, v in _entry(GOOD).items()}}),
    "not utf-8": b"\xff\xfe\x00garbage",
    "deep nesting": "[" * 100000,
    "huge integer": '{"format": ' + "9" * 5000 + "}",
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_bad_cache_file_warns_once_and_falls_back(name):
    path = user_file()
    path.parent.mkdir(parents=True)
    content = BAD_FILES[name]
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    args = small_args()
    heuristic = tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args, from_autotuning_cache=True) == heuristic
    messages = [str(w.message) for w in caught if "autotuning cache file" in str(w.message)]
    assert len(messages) == 1 and str(path) in messages[0]


def test_writing_never_erases_a_file_it_cannot_parse():
    path = user_file()
    path.parent.mkdir(parents=True)
    foreign = _file(_entry(GOOD), format="tokamax_torch.autotuning/2")
    path.write_text(foreign)
    with pytest.warns(RuntimeWarning, match="moved it to"):
        tune(*small_args(), products=["forward"])
    kept = list(path.parent.glob("ragged_dot.json.bad-*"))
    assert len(kept) == 1 and kept[0].read_text() == foreign
    assert cache_mod.parse_file(path.read_text(), "ragged_dot", tokamax_torch.device_kind(), rd.Config)


def test_written_files_are_readable_by_others():
    old = os.umask(0o022)
    try:
        tune(*small_args(), products=["forward"])  # a new file: 0666 less the umask, not mkstemp's 0600
        assert user_file().stat().st_mode & 0o777 == 0o644
        user_file().chmod(0o664)
        tune(*small_args(), products=["dlhs"])     # an existing file keeps its mode
        assert user_file().stat().st_mode & 0o777 == 0o664
    finally:
        os.umask(old)


def test_good_file_is_used_and_user_entries_win(tmp_path):
    shipped = tmp_path / "shipped"
    kind = tokamax_torch.device_kind()
    (shipped / kind).mkdir(parents=True)
    other = dict(GOOD, block_k=128)
    (shipped / kind / "ragged_dot.json").write_text(_file(_entry(other)))
    cache = cache_mod.ConfigCache("ragged_dot", kind, rd.Config, shipped_root=shipped)
    lhs, rhs, gs = small_args()
    key = rd.kernel.cache_key(lhs, rhs, gs, product="forward")
    assert cache.lookup(key) == rd.Config(**other)  # shipped data alone
    user_file().parent.mkdir(parents=True)
    user_file().write_text(_file(_entry(GOOD)))
    assert cache.lookup(key) == rd.Config(**GOOD)   # the user directory wins
    assert cache.lookup(dict(key, product="dlhs")) is None


def test_unwritable_or_missing_cache_dir_warns_and_carries_on(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(tokamax_torch.config, "cache_dir", str(blocker / "cache"))
    args = small_args()
    assert tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args, from_autotuning_cache=True)  # missing dir: fine
    with pytest.warns(RuntimeWarning, match="cannot write the autotuning cache"):
        result = tune(*args, products=["forward"])
    assert result.cache_path is None and result.products[0].best is not None


def test_shipped_cache_files_are_valid():
    files = sorted(cache_mod.SHIPPED_ROOT.glob("*/*.json"))
    for path in files:
        kind, op = path.parent.name, path.stem
        config_cls = getattr(tokamax_torch.ops, op).kernel.config_cls
        entries = cache_mod.parse_file(path.read_text(), op, kind, config_cls)
        assert entries, path


# ---- several processes --------------------------------------------------------------------------

TUNE_SCRIPT = """
import sys, torch, tokamax_torch
m = int(sys.argv[1])
lhs, rhs, gs = torch.randn(m, 64), torch.randn(2, 64, 32), torch.tensor([m // 2, m - m // 2], dtype=torch.int32)
r = tokamax_torch.autotune(tokamax_torch.ragged_dot, lhs, rhs, gs, max_configs=6, reps=2,
                           progress=False)
print(r.products[0].best.to_list())
"""
LOOKUP_SCRIPT = """
import sys, torch, tokamax_torch
tokamax_torch.config.autotuning_cache_miss = "error"
m = int(sys.argv[1])
args = (torch.empty(m, 64, device="meta"), torch.empty(2, 64, 32, device="meta"),
        torch.empty(2, dtype=torch.int32, device="meta"))
print(tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args, from_autotuning_cache=True)[0].to_list())
"""


def _env(cache_dir):
    return dict(os.environ, TOKAMAX_TORCH_CACHE_DIR=str(cache_dir), PYTHONPATH=str(REPO))


def test_second_process_loads_what_the_first_tuned(user_cache):
    first = subprocess.run([sys.executable, "-c", TUNE_SCRIPT, "80"], env=_env(user_cache), capture_output=True,
                           text=True, check=True).stdout.strip()
    second = subprocess.run([sys.executable, "-c", LOOKUP_SCRIPT, "80"], env=_env(user_cache), capture_output=True,
                            text=True, check=True)
    # The lookup process would raise on a miss (autotuning_cache_miss="error"); it tunes nothing.
    assert second.stdout.strip() == first


def test_concurrent_autotuners_merge_into_one_valid_file(user_cache):
    procs = [subprocess.Popen([sys.executable, "-c", TUNE_SCRIPT, str(m)], env=_env(user_cache),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for m in (70, 90)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    path = user_cache / "autotuning" / tokamax_torch.device_kind() / "ragged_dot.json"
    entries = cache_mod.parse_file(path.read_text(), "ragged_dot", tokamax_torch.device_kind(), rd.Config)
    assert sorted(json.loads(k)["lhs"]["shape"][0] for k in entries) == [70, 70, 70, 90, 90, 90]
    assert not list(path.parent.glob("*.tmp"))


def test_command_line(user_cache):
    out = subprocess.run(
        [sys.executable, "-m", "tokamax_torch.autotune", "ragged_dot", "--shape", "64,32,32,2", "--dtype", "bfloat16",
         "--max-configs", "2", "--reps", "1"], env=_env(user_cache), capture_output=True, text=True, check=True).stdout
    assert "shape 64,32,32,2, bfloat16" in out and "best config" in out and "written to" in out
    sized = subprocess.run(
        [sys.executable, "-m", "tokamax_torch.autotune", "ragged_dot", "--shape", "16,8,8,2", "--group-sizes", "6,10",
         "--max-configs", "2", "--reps", "1", "--no-write"], env=_env(user_cache), capture_output=True, text=True,
        check=True).stdout
    assert "best config" in sized
    bad = subprocess.run([sys.executable, "-m", "tokamax_torch.autotune", "ragged_dot", "--shape", "1,2"],
                         env=_env(user_cache), capture_output=True, text=True)
    assert bad.returncode != 0 and "--shape must be M,K,N,G" in bad.stderr
    # A shape the op itself refuses (group sizes that do not add up to M): its message, no traceback.
    refused = subprocess.run(
        [sys.executable, "-m", "tokamax_torch.autotune", "ragged_dot", "--shape", "16,8,8,2", "--group-sizes", "6,11",
         "--reps", "1", "--no-write"], env=_env(user_cache), capture_output=True, text=True)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--shape 16,8,8,2 (float32)" in refused.stderr and "group_sizes" in refused.stderr


def test_command_line_tunes_dot_product_attention(user_cache):
    from tokamax_torch.ops import dot_product_attention as dpa

    out = subprocess.run(
        [sys.executable, "-m", "tokamax_torch.autotune", "dot_product_attention", "--shape", "1,32,48,4,2,16",
         "--causal", "--window", "8,0", "--dtype", "bfloat16", "--max-configs", "2", "--reps", "1"],
        env=_env(user_cache), capture_output=True, text=True, check=True).stdout
    assert "shape 1,32,48,4,2,16, bfloat16" in out and "written to" in out
    # The entry is found by a call with the same shapes, dtype and mask arguments.
    q = torch.empty(1, 32, 4, 16, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 48, 2, 16, dtype=torch.bfloat16, device="meta")
    fwd, bwd = tokamax_torch.get_configs(dpa.kernel, q, k, k, is_causal=True, local_window_size=(8, 0),
                                         from_autotuning_cache=True)
    assert isinstance(fwd, dpa.Config) and isinstance(bwd, dpa.Config)
    for argv, message in (
            (["--shape", "1,2,3"], "--shape must be B,T,S,N,K,H or B,T,S,N,K,H,Hv"),
            (["--shape", "1,4,4,2,2,8", "--window", "a"], "--window must be W or LEFT,RIGHT"),
            (["--shape", "1,4,4,2,2,8", "--form", "trans_rhs"], "--form does not apply to dot_product_attention")):
        bad = subprocess.run([sys.executable, "-m", "tokamax_torch.autotune", "dot_product_attention", *argv],
                             env=_env(user_cache), capture_output=True, text=True)
        assert bad.returncode != 0 and message in bad.stderr, bad.stderr
    wrong_op = subprocess.run([sys.executable, "-m", "tokamax_torch.autotune", "ragged_dot", "--shape", "8,8,8,2",
                               "--causal"], env=_env(user_cache), capture_output=True, text=True)
    assert wrong_op.returncode != 0 and "--causal does not apply to ragged_dot" in wrong_op.stderr


# ---- the command line module and the function ---------------------------------------------------

SHADOW_SCRIPT = """
import importlib, inspect, pkgutil, sys, types
import tokamax_torch.autotune  # the command line's module, imported before anything else
import tokamax_torch
function = tokamax_torch.autotuning.autotune
assert tokamax_torch.autotune is function and inspect.isfunction(function)
import tokamax_torch.autotune as spelled_out
from tokamax_torch import autotune
assert spelled_out is function and autotune is function
assert isinstance(sys.modules["tokamax_torch.autotune"], types.ModuleType)
public = {name: getattr(tokamax_torch, name) for name in tokamax_torch.__all__}
import importlib.util
for info in pkgutil.walk_packages(tokamax_torch.__path__, "tokamax_torch."):
    # an integration module imports its optional library (tokamax_torch.integrations.transformers)
    if info.name.startswith("tokamax_torch.integrations.") and importlib.util.find_spec(info.name.rsplit(".", 1)[1]) is None:
        continue
    if not info.name.endswith("._C"):
        importlib.import_module(info.name)
changed = [name for name, value in public.items() if getattr(tokamax_torch, name) is not value]
assert not changed, changed
print("function", tokamax_torch.autotune.__module__)
"""


def test_autotune_stays_the_function_whatever_is_imported(user_cache):
    out = subprocess.run([sys.executable, "-c", SHADOW_SCRIPT], env=_env(user_cache), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["function", "tokamax_torch.autotuning.autotuner"]


@pytest.mark.parametrize("module", ["tokamax_torch.autotune", "tokamax_torch.autotuning.cli"])
def test_command_line_runs_as_a_module(module, user_cache):
    out = subprocess.run([sys.executable, "-m", module, "--help"], env=_env(user_cache), capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m tokamax_torch.autotune")
    assert "products forward, dlhs, drhs; --shape M,K,N,G" in out.stdout
    assert "products forward, backward; --shape B,T,S,N,K,H[,Hv]" in out.stdout


def test_command_line_is_built_from_the_registry(capsys):
    from tokamax_torch import _registry
    from tokamax_torch.autotuning import cli

    _, per_op = cli.build_parser()
    assert list(per_op) == list(_registry.tunable_families())
    for name, sub in per_op.items():
        kernel = _registry.family(name).kernel
        assert kernel.cli_shape in sub.format_help()
    for argv, message in (
            (["ragged_dot", "--shape", "8,8,8,2", "--soft-cap", "3"],
             "--soft-cap does not apply to ragged_dot (it is a flag of dot_product_attention)"),
            (["ragged_dot", "--shape", "8,8,8,2", "--fast"], "unrecognized arguments: --fast"),
            (["ragged_dot", "--shape", "8,8,8,2", "--products", "forward,backward"],
             "--products: ragged_dot has products ['forward', 'dlhs', 'drhs'], got 'backward'"),
            (["ragged_dot", "--shape", "8,8,8,2", "--group-sizes", "4,x"], "--group-sizes must be ints"),
            (["ragged_dot", "--shape", "8,8,8,2", "--reps", "0"], "--reps must be >= 1"),
            (["matmul", "--shape", "8,8"], "invalid choice: 'matmul'")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


# ---- an audit of the configs and autotuning machinery (2026-12-07) ---------------------------------


def test_two_unparseable_files_moved_aside_keep_both_backups():
    # Backups were named by the second: a second file moved aside in the same second replaced
    # the first backup, losing the user's data.
    path = user_file()
    path.parent.mkdir(parents=True)
    foreign = [_file(_entry(GOOD), format=f"tokamax_torch.autotuning/{n}") for n in (2, 3)]
    for text in foreign:
        path.write_text(text)
        with pytest.warns(RuntimeWarning, match="moved it to"):
            tune(*small_args(), products=["forward"])
    kept = sorted(p.read_text() for p in path.parent.glob("ragged_dot.json.bad-*"))
    assert kept == sorted(foreign)


def test_autotuning_runs_on_a_copy_of_a_donated_cache():
    # Every candidate run of ragged_paged_attention writes its new tokens into the kv cache: the
    # tuner must run them on a copy, leaving the caller's cache as it was.
    from test_ragged_paged_attention import problem
    args = problem()
    before = args[3].clone()
    tokamax_torch.autotune(tokamax_torch.ragged_paged_attention, *args, write_cache=False, max_configs=2, reps=1,
                           warmup=0, progress=False)
    assert torch.equal(args[3], before)


def test_a_run_of_some_products_still_gives_a_whole_config_pair(monkeypatch):
    # products="forward" (a string, once iterated by character) tunes the forward only; the
    # result's configs fill the backward with its heuristic (once a KeyError). Without tqdm (an
    # optional extra) the progress bar is left out instead of failing the run.
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    args = small_args()
    result = tokamax_torch.autotune(tokamax_torch.ragged_dot, *args, products="forward", write_cache=False,
                                    max_configs=2, reps=1, warmup=0, progress=True)
    fwd, bwd = result.configs
    assert [p.product for p in result.products] == ["forward"]
    assert bwd == tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args)[1]
    assert isinstance(fwd, rd.Config)


def test_another_ops_config_is_refused():
    # The C++ side checks a config's width and bounds only: another op's Config of the same
    # width would run with its fields reinterpreted by position.
    from tokamax_torch.ops import dot_product_attention as dpa
    from tokamax_torch.ops import linear_softmax_cross_entropy_loss as lce
    from tokamax_torch.ops import ragged_paged_attention as rpa
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="configs\\[0\\] must be Config of dot_product_attention.*got "
                                        "tokamax_torch.ops.linear_softmax_cross_entropy_loss.Config"):
        dpa.kernel(q, q, q, configs=(lce.Config(16, 16, 256), None))
    with pytest.raises(TypeError, match="no backward config; configs\\[1\\] must be None, got 'abc'"):
        rpa.kernel(*([q] * 8), configs=(None, "abc"))
    out = dpa.kernel(q, q, q, configs=(dpa.Config(8, 8, 1), [8, 8, 1]))  # its own Config, or ints
    assert out.shape == q.shape


def test_settings_from_the_environment_never_break_the_import(tmp_path):
    # A bad TOKAMAX_TORCH_AUTOTUNING_CACHE_MISS once made `import tokamax_torch` raise; now it
    # warns, naming the variable, and keeps the default. Empty means unset; ~ is expanded; an
    # out-of-range TOKAMAX_BUFFER_CACHE_MIB no longer wraps the limit to 0 or below.
    code = ("import warnings, tokamax_torch as t\n"
            "print(t.config.autotuning_cache_miss, t.config.cache_dir, t.cache_limit())\n")
    env = dict(os.environ, TOKAMAX_TORCH_AUTOTUNING_CACHE_MISS="WARN", TOKAMAX_TORCH_CACHE_DIR="~/tt",
               HOME=str(tmp_path), TOKAMAX_BUFFER_CACHE_MIB=str(2 ** 44))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    miss, cache_dir, limit = done.stdout.split()
    assert miss == "heuristics" and cache_dir == str(tmp_path / "tt") and int(limit) == 2 ** 62
    assert "TOKAMAX_TORCH_AUTOTUNING_CACHE_MISS='WARN' ignored" in done.stderr
    with pytest.raises(ValueError, match="cache_dir must be a non-empty path, got None"):
        tokamax_torch.config.cache_dir = None


def test_lookups_reuse_the_parsed_file_until_it_changes(monkeypatch):
    # Lookups keep each parsed file by its stat (an audit timed 295 ms per get_configs with a
    # 2000-entry file re-read per product); a file written since is read again.
    args = small_args()
    tune(*args, products=["forward"])
    reads = []
    real_read = cache_mod.ConfigCache._read
    # (A file that does not exist, such as the shipped one of a class without one, is not kept:
    # looking for it is one failed stat.)
    monkeypatch.setattr(cache_mod.ConfigCache, "_read",
                        lambda self, path: (reads.append(path) if path == user_file() else None) or real_read(self, path))
    first = tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args, from_autotuning_cache=True)
    count = len(reads)
    assert tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args, from_autotuning_cache=True) == first
    assert len(reads) == count  # nothing read again
    path = user_file()
    data = json.loads(path.read_text())
    key = next(iter(data["entries"]))
    for result in data["entries"][key]["results"]:
        result["median_ms"] = 1e9
    fastest = data["entries"][key]["results"][-1]
    fastest["median_ms"] = 1e-9
    replacement = path.with_name("replacement.json")
    replacement.write_text(json.dumps(data))
    os.replace(replacement, path)
    changed = tokamax_torch.get_configs(tokamax_torch.ragged_dot, *args, from_autotuning_cache=True)
    assert dataclasses.asdict(changed[0]) == fastest["config"] and len(reads) > count
