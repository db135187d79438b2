import pytest
import torch

import tokamax_torch


@pytest.fixture(autouse=True)
def _seed_and_reset():
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    """Every test gets its own (empty) user autotuning cache and fresh once-per-file warnings,
    so no test depends on what someone tuned on this machine."""
    from tokamax_torch.autotuning import cache as cache_mod

    monkeypatch.setattr(tokamax_torch.config, "cache_dir", str(tmp_path / "cache"))
    monkeypatch.setattr(tokamax_torch.config, "autotuning_cache_miss", "heuristics")
    monkeypatch.setattr(cache_mod, "_warned", set())
    return tmp_path / "cache"
