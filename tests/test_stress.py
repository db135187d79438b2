"""Stress: the kernels called from several Python threads at once give the bits they give alone.

Every call (ragged_dot and dot_product_attention, forward and backward, fp32 and bf16, sizes from
a few KiB of working memory to tens of MiB) is first run alone, one after the other. Then all of
them run again from worker threads, several rounds in a shuffled order, while another thread
empties the kernels' cached working memory now and then, and each result must equal its lone run
bit for bit. The large calls take their working buffers from the process-wide cache of mappings
(csrc/core/runtime/large_buffer.h), so buffers freed by one call are reused by calls of other sizes on
other threads; a kernel that writes into a buffer after releasing it, or reads one it does not
own, shows up here as changed bits. Every call's scratch comes from its threads' arenas
(csrc/core/runtime/scratch_arena.h), which the emptying thread frees while idle and marks while
leased: freeing one in use would show up the same way.

Thread counts: each phase sets the process-wide count (1, 2, 3), and each worker also sets its
own count before every call (ATen's OpenMP backend keeps the count per calling thread), so calls
run at different counts side by side. The kernels promise the same bits at any count; their
configs depend on shapes only (the heuristic for configs=None).
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
from typing import Callable

import pytest
import torch

import tokamax_torch
from tokamax_torch.ops import dot_product_attention as dpa
from tokamax_torch.ops import ragged_dot as rd

WORKERS = 4
PHASE_THREAD_COUNTS = (1, 2, 3)
#: Per-call thread counts the workers cycle through (on top of the phase's process-wide count).
CALL_THREAD_COUNTS = (1, 2, 3)
ROUNDS_PER_PHASE = 3
#: Each round runs every case this many times, in a shuffled order (the same call side by side too).
COPIES_PER_ROUND = 3
#: How long the cache-emptying thread waits between empties: long enough that calls in between
#: reuse cached mappings, short enough that it empties many times per round.
EMPTY_CACHE_INTERVAL_S = 0.005
#: What the buffer cache may hold (TOKAMAX_BUFFER_CACHE_MIB, else a default from the memory size).
_CACHE_LIMIT_BYTES = tokamax_torch.cache_limit()


@dataclasses.dataclass
class Case:
    """One call of a kernel: fixed inputs, leaves (the inputs that get gradients) and the
    cotangents of its outputs; run() returns its outputs and the leaves' gradients."""

    id: str
    fn: Callable
    args: tuple
    kwargs: dict
    leaves: list[torch.Tensor]
    cotangents: list[torch.Tensor]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the call reads."""
        return [x for x in (*self.args, *self.kwargs.values(), *self.cotangents) if isinstance(x, torch.Tensor)]

    def run(self) -> list[torch.Tensor]:
        out = self.fn(*self.args, **self.kwargs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        # torch.autograd.grad with explicit cotangents: no ATen reduction after the kernel (whose
        # summation order could follow the thread count), and no shared .grad between threads.
        grads = torch.autograd.grad(outs, self.leaves, self.cotangents)
        return [x.detach() for x in outs] + list(grads)


def _randn(gen: torch.Generator, *shape, dtype=torch.float32, grad=False) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(grad)


def _cotangents(gen: torch.Generator, fn, args, kwargs) -> list[torch.Tensor]:
    with torch.no_grad():
        out = fn(*args, **kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [torch.randn(x.shape, generator=gen).to(x.dtype) for x in outs]


def _attention(id, seed, b, t, s, n, k, h, dtype, bias_shape=None, **kwargs) -> Case:
    gen = torch.Generator().manual_seed(seed)
    q = _randn(gen, b, t, n, h, dtype=dtype, grad=True)
    key = _randn(gen, b, s, k, h, dtype=dtype, grad=True)
    value = _randn(gen, b, s, k, h, dtype=dtype, grad=True)
    bias = None if bias_shape is None else _randn(gen, *bias_shape, dtype=dtype, grad=True)
    args = (q, key, value, bias)
    leaves = [q, key, value] + ([bias] if bias is not None else [])
    return Case(id, dpa.kernel, args, kwargs, leaves, _cotangents(gen, dpa.kernel, args, kwargs))


def _group_sizes(gen: torch.Generator, m: int, groups: int, total: int) -> torch.Tensor:
    """`groups` non-negative sizes summing to `total` (<= m), uneven, some possibly zero."""
    cuts = torch.randint(0, total + 1, (groups - 1,), generator=gen).sort().values
    edges = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])
    return (edges[1:] - edges[:-1]).to(torch.int32)


def _ragged_dot(id, seed, form, m, k, n, groups, dtype, total=None, **kwargs) -> Case:
    gen = torch.Generator().manual_seed(seed)
    lhs = _randn(gen, m, k, dtype=dtype, grad=True)
    rhs_shape = {rd.DEFAULT: (groups, k, n), rd.TRANS_RHS: (groups, n, k), rd.RAGGED_CONTRACTING: (m, n)}[form]
    rhs = _randn(gen, *rhs_shape, dtype=dtype, grad=True)
    gs = _group_sizes(gen, m, groups, m if total is None else total)
    args = (lhs, rhs, gs)
    kwargs = {"ragged_dot_dimension_numbers": form, **kwargs}
    return Case(id, rd.kernel, args, kwargs, [lhs, rhs], _cotangents(gen, rd.kernel, args, kwargs))


def _cases() -> list[Case]:
    f32, bf16 = torch.float32, torch.bfloat16
    return [
        # Working memory of several MiB each (packed K/V, backward partial sums): mapped, cached
        # and reused across sizes (a cached mapping serves requests down to half its size).
        _attention("attn-f32", 1, 1, 256, 1024, 4, 4, 64, f32),
        _attention("attn-f32-causal-gqa-lse", 2, 2, 128, 1536, 4, 2, 64, f32, is_causal=True,
                   return_residuals=True),
        _attention("attn-f32-large", 13, 1, 512, 4096, 8, 4, 64, f32, is_causal=True),  # ~40 MiB
        _attention("attn-f32-wide", 3, 1, 512, 512, 8, 8, 64, f32, local_window_size=(200, 50)),
        _attention("attn-bf16", 4, 1, 256, 2048, 4, 2, 64, bf16),
        _attention("attn-bf16-large", 14, 1, 512, 4096, 8, 4, 128, bf16),  # ~48 MiB
        _attention("attn-bf16-causal", 5, 2, 128, 1536, 4, 4, 64, bf16, is_causal=True),
        _attention("attn-bf16-decode", 6, 2, 1, 2048, 8, 2, 64, bf16, logits_soft_cap=2.0),
        # Below the mapping threshold: malloc'd and thread-local scratch only.
        _attention("attn-f32-bias-shared", 7, 3, 40, 72, 4, 2, 32, f32, bias_shape=(4, 40, 72), is_causal=True),
        _attention("attn-f32-small", 8, 2, 9, 13, 4, 2, 16, f32, return_residuals=True),
        _ragged_dot("rd-f32", 9, rd.DEFAULT, 1024, 256, 256, 4, f32),
        _ragged_dot("rd-bf16-trans-rhs", 10, rd.TRANS_RHS, 512, 512, 384, 8, bf16, total=480),
        _ragged_dot("rd-f32-ragged-contracting", 11, rd.RAGGED_CONTRACTING, 600, 128, 96, 5, f32),
        _ragged_dot("rd-bf16-to-f32", 12, rd.DEFAULT, 300, 200, 100, 6, bf16, total=280,
                    preferred_element_type=torch.float32),
    ]


def _run_concurrently(cases: list[Case], order: list[int], call_threads: list[int]) -> dict[int, list]:
    """Runs cases[order[i]] at call_threads[i] threads from WORKERS threads, while another thread
    empties the buffer cache; returns {i: results}. A worker's exception is raised here."""
    tasks: queue.Queue = queue.Queue()
    for i in range(len(order)):
        tasks.put(i)
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    done = threading.Event()

    def worker():
        try:
            while True:
                try:
                    i = tasks.get_nowait()
                except queue.Empty:
                    return
                torch.set_num_threads(call_threads[i])
                results[i] = cases[order[i]].run()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def empty_cache_now_and_then():
        while not done.wait(EMPTY_CACHE_INTERVAL_S):
            held = tokamax_torch.cached_bytes()
            if held > _CACHE_LIMIT_BYTES:
                errors.append(AssertionError(f"the buffer cache holds {held} bytes, over its limit"))
            tokamax_torch.empty_cache()

    emptier = threading.Thread(target=empty_cache_now_and_then)
    workers = [threading.Thread(target=worker) for _ in range(WORKERS)]
    emptier.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    emptier.join()
    if errors:
        raise errors[0]
    return results


def test_concurrent_calls_give_the_bits_of_lone_calls():
    cases = _cases()
    inputs = [[x.detach().clone() for x in case.tensors()] for case in cases]
    tokamax_torch.empty_cache()
    alone = [case.run() for case in cases]  # at the process's thread count, one call at a time
    if _CACHE_LIMIT_BYTES > 0:
        # The large calls went through the mapping cache (else this test would not cover it).
        assert tokamax_torch.cached_bytes() > 0
    # A second lone pass on warm, reused buffers: the baseline itself is stable.
    for case, want in zip(cases, alone):
        _assert_bitwise_equal(case.run(), want, f"{case.id}: a second lone run")

    rng = random.Random(18)
    before = torch.get_num_threads()
    try:
        for phase_threads in PHASE_THREAD_COUNTS:
            torch.set_num_threads(phase_threads)
            for round_ in range(ROUNDS_PER_PHASE):
                order = [i for i in range(len(cases)) for _ in range(COPIES_PER_ROUND)]
                rng.shuffle(order)
                call_threads = [rng.choice(CALL_THREAD_COUNTS) for _ in order]
                results = _run_concurrently(cases, order, call_threads)
                assert sorted(results) == list(range(len(order)))
                for i, got in results.items():
                    case = cases[order[i]]
                    _assert_bitwise_equal(got, alone[order[i]], f"{case.id} at {call_threads[i]} threads (phase "
                                          f"{phase_threads} threads, round {round_}) against its lone run")
    finally:
        torch.set_num_threads(before)
        tokamax_torch.empty_cache()
    assert tokamax_torch.cached_bytes() == 0
    for case, before_calls in zip(cases, inputs):  # nothing wrote into memory it only reads
        _assert_bitwise_equal([x.detach() for x in case.tensors()], before_calls, f"{case.id}: its inputs afterwards")


def _assert_bitwise_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for j, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: result {j} is {g.dtype}{list(g.shape)}"
        if not torch.equal(g, w):
            diff = (g.double() - w.double()).abs().max().item()
            pytest.fail(f"{what}: result {j} differs in its bits (max abs difference {diff:.3g})")
