"""One memory model: every piece of working memory the kernels keep between calls (the per-thread
scratch arenas of csrc/core/runtime/scratch_arena.h and the large-buffer cache) is counted by
``cached_bytes()`` and freed by ``empty_cache()``, and a call after ``empty_cache()`` (fresh
memory) gives the bits of one before it (reused memory)."""

from __future__ import annotations

import os

import pytest
import torch

import tokamax_torch

_CACHE_MIB = os.environ.get("TOKAMAX_BUFFER_CACHE_MIB", "")
pytestmark = pytest.mark.skipif(_CACHE_MIB.isdigit() and int(_CACHE_MIB) == 0,
                                reason="TOKAMAX_BUFFER_CACHE_MIB=0 caches nothing")


def _calls(dtype, size):
    """Attention forward+backward and ragged_dot forward+backward, their outputs and gradients."""
    g = torch.Generator().manual_seed(7)
    t, n, h = size, 4, 64
    q, k, v, dout = (torch.randn(1, t, n, h, generator=g).to(dtype) for _ in range(4))
    lhs = torch.randn(96, 128, generator=g).to(dtype)
    rhs = torch.randn(3, 128, 80, generator=g).to(dtype)
    group_sizes = torch.tensor([40, 0, 50])
    dres = torch.randn(96, 80, generator=g).to(dtype)

    def run():
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = tokamax_torch.dot_product_attention(*leaves, is_causal=True)
        grads = torch.autograd.grad(out, leaves, dout)
        a, b = lhs.clone().requires_grad_(True), rhs.clone().requires_grad_(True)
        res = tokamax_torch.ragged_dot(a, b, group_sizes)
        rgrads = torch.autograd.grad(res, (a, b), dres)
        return [out, *grads, res, *rgrads]

    return run


def _assert_bitwise_equal(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scratch_is_counted_and_freed(dtype):
    # Small calls: no buffer reaches the large-buffer cache's 1 MiB threshold, so what is cached is
    # the kernels' per-thread scratch (GEMM panels, attention's task buffers) alone.
    run = _calls(dtype, 128)
    tokamax_torch.empty_cache()
    assert tokamax_torch.cached_bytes() == 0
    before = run()
    assert tokamax_torch.cached_bytes() > 0
    tokamax_torch.empty_cache()
    assert tokamax_torch.cached_bytes() == 0
    _assert_bitwise_equal(run(), before)  # on fresh memory
    _assert_bitwise_equal(run(), before)  # on reused memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_calls_are_counted_and_freed(dtype):
    # Packed K/V copies of 2 MiB and more: mapped, then kept in the large-buffer cache too.
    run = _calls(dtype, 2048)
    tokamax_torch.empty_cache()
    before = run()
    held = tokamax_torch.cached_bytes()
    assert held > 0
    assert held <= tokamax_torch.cache_limit()
    tokamax_torch.empty_cache()
    assert tokamax_torch.cached_bytes() == 0
    _assert_bitwise_equal(run(), before)
    tokamax_torch.empty_cache()
    assert tokamax_torch.cached_bytes() == 0
