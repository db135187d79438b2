"""Pooled outputs (docs/design.md, "Pooled outputs"): op outputs and gradients over 1 MiB come from
the large-buffer cache, and a freed output's memory serves a later call's, holding whatever was
written there. These tests check that outputs stay correct and independent under that reuse: two
live outputs never alias, a reused (NaN-poisoned) output gives the bits of a fresh one (so a
kernel leaving an element unwritten fails here), resize_ works, a tensor outlives the cache being
emptied or turned off, and a limit of 0 turns the pool off."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import tokamax_torch

_CACHE_MIB = os.environ.get("TOKAMAX_BUFFER_CACHE_MIB", "")
pytestmark = pytest.mark.skipif(_CACHE_MIB.isdigit() and int(_CACHE_MIB) < 64,
                                reason="the pool needs a cache limit of a few tens of MiB")

_HUGE = 2 << 20  # a pooled output starts on a 2 MiB boundary


def _new(*size, dtype=torch.float32):
    return torch.ops.tokamax._new_output(list(size), dtype)


def _span(t):
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def _disjoint(a, b):
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a1 <= b0 or b1 <= a0


@pytest.fixture(autouse=True)
def _fresh_cache():
    limit = tokamax_torch.cache_limit()
    tokamax_torch.empty_cache()
    yield
    tokamax_torch.set_cache_limit(limit)
    tokamax_torch.empty_cache()


def test_large_outputs_are_pooled_and_small_ones_are_not():
    big = _new(1024, 1024)  # 4 MiB
    assert big.data_ptr() % _HUGE == 0
    assert big.is_contiguous() and big.shape == (1024, 1024)
    ptr = big.data_ptr()
    del big
    assert tokamax_torch.cached_bytes() >= 4 << 20
    again = _new(1000, 1024)  # a little smaller: the same mapping
    assert again.data_ptr() == ptr
    assert tokamax_torch.cached_bytes() < 4 << 20
    small = _new(16, 1024)  # 64 KiB: torch's allocator
    held = tokamax_torch.cached_bytes()
    del small
    assert tokamax_torch.cached_bytes() == held


def test_live_outputs_never_alias():
    x = torch.randn(512, 1024)
    outs = [tokamax_torch.layer_norm(x + i) for i in range(4)] + [_new(512, 1024) for _ in range(4)]
    for i in range(len(outs)):
        for j in range(i):
            assert _disjoint(outs[i], outs[j]), (i, j)
    for i in range(4):  # each output is its own, written once
        assert torch.equal(outs[i], tokamax_torch.layer_norm(x + i))


def test_a_reused_output_is_correct():
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(1024, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    fresh = tokamax_torch.layer_norm(x2).clone()
    y = tokamax_torch.layer_norm(x1)
    ptr = y.data_ptr()
    y.fill_(float("nan"))
    del y
    y2 = tokamax_torch.layer_norm(x2)
    assert y2.data_ptr() == ptr  # the freed output's memory, NaN-filled
    assert torch.equal(y2, fresh)


def test_resize_grows_through_the_pool():
    out = tokamax_torch.layer_norm(torch.randn(512, 1024))
    want = out.clone()
    out.resize_(1024, 1024)
    assert torch.equal(out[:512], want)
    out[512:] = 2.0
    assert out.data_ptr() % _HUGE == 0
    assert torch.equal(out[512:], torch.full((512, 1024), 2.0))
    out.resize_(8, 8)  # shrinking keeps the storage
    assert torch.equal(out.flatten(), want.flatten()[:64])


def test_outputs_outlive_the_cache():
    x = torch.randn(1024, 1024)
    y = tokamax_torch.layer_norm(x)
    want = y.clone()
    _new(2048, 1024)  # something in the cache
    tokamax_torch.empty_cache()
    tokamax_torch.set_cache_limit(0)
    assert tokamax_torch.cached_bytes() == 0
    assert torch.equal(y, want)
    y.add_(1.0)  # still writable memory
    assert torch.equal(y, want + 1.0)
    del y  # released with the cache off: unmapped, not kept
    assert tokamax_torch.cached_bytes() == 0


def test_limit_zero_turns_the_pool_off():
    tokamax_torch.set_cache_limit(0)
    out = tokamax_torch.layer_norm(torch.randn(1024, 1024))
    del out
    assert tokamax_torch.cached_bytes() == 0
    with pytest.raises(RuntimeError, match="nbytes must be >= 0"):
        tokamax_torch.set_cache_limit(-1)
    code = ("import torch, tokamax_torch as t; y = t.layer_norm(torch.randn(1024, 1024)); del y;"
            " print(t.cache_limit(), t.cached_bytes())")
    env = dict(os.environ, TOKAMAX_BUFFER_CACHE_MIB="0")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["0", "0"]


def test_default_limit_is_bounded():
    env = {k: v for k, v in os.environ.items() if k != "TOKAMAX_BUFFER_CACHE_MIB"}
    code = "import tokamax_torch as t; print(t.cache_limit())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert 256 << 20 <= int(result.stdout) <= 4 << 30


def test_outputs_freed_on_other_threads():
    # The deleter returns mappings to the cache from whichever thread drops the last reference.
    x = torch.randn(512, 1024)
    want = tokamax_torch.layer_norm(x)
    errors = []

    def worker(seed):
        try:
            for i in range(20):
                out = tokamax_torch.layer_norm(x) if (seed + i) % 2 else _new(700, 1024).fill_(float(seed))
                if (seed + i) % 2:
                    assert torch.equal(out, want)
                else:
                    assert bool((out == seed).all())
                holder.append(out)  # freed by another thread's clear
                if len(holder) > 8:
                    holder.clear()
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    holder = []
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---- every op's outputs and gradients on poisoned memory -----------------------------------------

def _case_layer_norm(g):
    x = torch.randn(640, 1024, generator=g, requires_grad=True)
    res = torch.randn(640, 1024, generator=g, requires_grad=True)
    scale = torch.randn(1024, generator=g, requires_grad=True)
    offset = torch.randn(1024, generator=g, requires_grad=True)
    dy, dh = torch.randn(640, 1024, generator=g), torch.randn(640, 1024, generator=g)

    def run():
        y, h = tokamax_torch.layer_norm(x, scale, offset, residual=res)
        return [y, h, *torch.autograd.grad((y, h), (x, res, scale, offset), (dy, dh))]
    return run


def _case_rms_norm_bf16(g):
    x = torch.randn(1024, 1024, generator=g).bfloat16().requires_grad_(True)
    scale = torch.randn(1024, generator=g, requires_grad=True)
    dy = torch.randn(1024, 1024, generator=g).bfloat16()

    def run():
        y = tokamax_torch.rms_norm(x, scale)
        return [y, *torch.autograd.grad(y, (x, scale), dy)]
    return run


def _case_gathers(g):
    x = torch.randn(1024, 512, generator=g, requires_grad=True)
    idx = torch.randint(0, 1024, (1536,), generator=g, dtype=torch.int32)
    start, end = torch.tensor([100], dtype=torch.int32), torch.tensor([1400], dtype=torch.int32)
    w = torch.rand(1536, generator=g, requires_grad=True)
    mask = torch.rand(1536, generator=g) > 0.2
    dg, dr = torch.randn(1536, 512, generator=g), torch.randn(768, 512, generator=g)

    def run():
        a = tokamax_torch.ragged_gather(x, idx, start, end)
        b = tokamax_torch.ragged_scatter(x, idx, start, end - 500)  # bounds on x's rows
        c = tokamax_torch.ragged_gather_reduce(x, idx, w, mask, 2)
        return [a, b, c, *torch.autograd.grad((a, b, c), (x, w), (dg, dg, dr))]
    return run


def _case_glu(g):
    x = torch.randn(256, 512, generator=g, requires_grad=True)
    w = (torch.randn(512, 2, 768, generator=g) * 0.05).requires_grad_(True)
    dout = torch.randn(256, 768, generator=g)

    def run():
        y = tokamax_torch.gated_linear_unit(x, w)
        return [y, *torch.autograd.grad(y, (x, w), dout)]
    return run


def _case_ragged_dot(g):
    lhs = torch.randn(768, 512, generator=g, requires_grad=True)
    rhs = (torch.randn(3, 512, 640, generator=g) * 0.05).requires_grad_(True)
    sizes = torch.tensor([300, 0, 468])
    dout = torch.randn(768, 640, generator=g)

    def run():
        y = tokamax_torch.ragged_dot(lhs, rhs, sizes)
        return [y, *torch.autograd.grad(y, (lhs, rhs), dout)]
    return run


def _case_attention(g):
    q, k, v = (torch.randn(1, 512, 8, 128, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 512, 8, 128, generator=g)

    def run():
        y = tokamax_torch.dot_product_attention(q, k, v, is_causal=True)
        return [y, *torch.autograd.grad(y, (q, k, v), dout)]
    return run


def _case_lce(g):
    x = torch.randn(512, 256, generator=g, requires_grad=True)
    w = (torch.randn(256, 2048, generator=g) * 0.05).requires_grad_(True)
    labels = torch.randint(0, 2048, (512,), generator=g)

    def run():
        loss = tokamax_torch.linear_softmax_cross_entropy_loss(x, labels, w, reduction="none")
        return [loss, *torch.autograd.grad(loss.sum(), (x, w))]
    return run


def _case_fused_moe(g):
    x = (torch.randn(256, 256, generator=g) * 0.5).requires_grad_(True)
    w1 = (torch.randn(8, 256, 2 * 384, generator=g) * 0.05).requires_grad_(True)
    w2 = (torch.randn(8, 384, 256, generator=g) * 0.05).requires_grad_(True)
    gating = torch.randn(256, 8, generator=g, requires_grad=True)
    dout = torch.randn(256, 256, generator=g)

    def run():
        y = tokamax_torch.fused_moe(x, w1, w2, gating, topk=2)
        return [y, *torch.autograd.grad(y, (x, w1, w2, gating), dout)]
    return run


_CASES = {f.__name__[len("_case_"):]: f for f in (_case_layer_norm, _case_rms_norm_bf16, _case_gathers, _case_glu,
                                                   _case_ragged_dot, _case_attention, _case_lce, _case_fused_moe)}


def _bits(t):
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("case", sorted(_CASES))
def test_outputs_on_poisoned_memory(case):
    run = _CASES[case](torch.Generator().manual_seed(3))
    want = [t.detach().clone() for t in run()]  # fresh mappings (zero pages)
    assert any(t.nbytes > 1 << 20 for t in want), "the case must have pooled outputs"
    for _ in range(2):
        outs = run()
        poisoned = {t.data_ptr() for t in outs if t.nbytes > 1 << 20}
        for t in outs:  # poison every output and gradient, then free them into the cache
            t.detach().fill_(float("nan"))
        del outs, t
        got = run()  # outputs on the poisoned mappings
        if case != "lce":  # there the backward's own buffers may take the poisoned mapping first
            assert poisoned & {t.data_ptr() for t in got}, "no output reused a poisoned mapping"
        for a, b in zip(got, want):
            assert torch.equal(_bits(a), _bits(b))
