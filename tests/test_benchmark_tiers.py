"""benchmarks/common.py's tier selection (issue 22): tiers above the CPU's best are skipped."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import common  # noqa: E402


def test_all_skips_tiers_above_best_and_scalar():
    assert common.select_tiers("all", "avx512bf16") == (["avx2", "avx512", "avx512bf16"], ["amx"])
    assert common.select_tiers("all", "amx") == (["avx2", "avx512", "avx512bf16", "amx"], [])
    assert common.select_tiers("all", "avx2") == (["avx2"], ["avx512", "avx512bf16", "amx"])


def test_named_tiers_ordered_deduplicated_and_unsupported_skipped():
    assert common.select_tiers("amx,scalar,avx2,scalar", "avx512") == (["scalar", "avx2"], ["amx"])
    assert common.select_tiers("amx", "avx512bf16") == ([], ["amx"])


def test_unknown_tier_raises():
    with pytest.raises(ValueError, match="unknown tier"):
        common.select_tiers("avx2,sse9", "amx")


def test_every_tier_has_caps_and_the_best_tier_is_known():
    assert set(common.TIER_CAPS) == set(common.TIERS)
    assert common.best_cpu_tier() in common.TIERS


def test_best_tier_ignores_a_forced_lower_tier(monkeypatch):
    best = common.best_cpu_tier()
    monkeypatch.setenv("TOKAMAX_CPU_ISA", "scalar")
    assert common.best_cpu_tier() == best
    assert common.os.environ["TOKAMAX_CPU_ISA"] == "scalar"


def test_the_ceilings_probe_checks_its_arguments():
    # The benchmarks' in-process ceilings (torch.ops.tokamax._measure_ceilings): a negative FMA
    # count once returned a negative peak and an empty buffer 0 GB/s; both raise now, and 0 FMA
    # iterations (bandwidth only, as benchmarks/attention.py asks) still measures bandwidth.
    import torch
    import tokamax_torch  # noqa: F401  (loads the ops)
    with pytest.raises(RuntimeError, match="fma_iterations must be >= 0"):
        torch.ops.tokamax._measure_ceilings(torch.zeros(1024), -5)
    with pytest.raises(RuntimeError, match="buffer must hold at least one float per thread"):
        torch.ops.tokamax._measure_ceilings(torch.zeros(0), 3)
    assert torch.ops.tokamax._measure_ceilings(torch.zeros(1 << 16), 0)[2] > 0
