import pytest
import torch

import tokamax_torch


@pytest.fixture(autouse=True)
def _seed_and_reset():
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)  # whatever a test did, the next one starts at the same count


@pytest.fixture
def num_threads(request):
    """Runs a test at `request.param` threads (parametrize it with indirect=["num_threads"]; None
    keeps the count), restoring the count afterwards."""
    before = torch.get_num_threads()
    n = getattr(request, "param", None)
    if n is not None:
        torch.set_num_threads(n)
    yield torch.get_num_threads()
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    """Every test gets its own (empty) user autotuning cache and fresh once-per-file warnings,
    so no test depends on what someone tuned on this machine."""
    from tokamax_torch.autotuning import cache as cache_mod

    monkeypatch.setattr(tokamax_torch.config, "cache_dir", str(tmp_path / "cache"))
    monkeypatch.setattr(tokamax_torch.config, "autotuning_cache_miss", "heuristics")
    monkeypatch.setattr(cache_mod, "_warned", set())
    monkeypatch.setattr(cache_mod, "_parsed", {})
    return tmp_path / "cache"
