"""ragged_paged_attention: numerics against a float64 oracle (every option, GQA, dtypes, threads),
its special cases, its errors, and its CONTRACT (the shared suite adds the donation proofs: same
storage, no copy in Inductor code, peak RSS, compiled == eager including the cache)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample, copies_in_code
from strategies import PROFILE
from tokamax_torch.ops import ragged_paged_attention as rpa

from torch._inductor.utils import run_and_get_code

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def problem(q_lens=(1, 1, 5, 3), kv_lens=(7, 20, 9, 3), distribution=None, pages_per_seq=6, page_size=4,
            q_heads=4, kv_heads=2, d=16, dtype=torch.float32, index_dtype=torch.int32, padding=2, extra_pages=3,
            seed=0, q_dtype=None):
    """A batch: sequences with `q_lens` new tokens and `kv_lens` cached positions (their new tokens
    the last), each owning distinct random pages; `padding` tokens after the active ones.
    distribution defaults to: the leading q_len-1 sequences decode, the rest mixed."""
    g = torch.Generator().manual_seed(seed)
    seqs = len(q_lens)
    if distribution is None:
        decode = 0
        while decode < seqs and q_lens[decode] == 1:
            decode += 1
        distribution = (decode, decode, seqs)
    total_pages = seqs * pages_per_seq + extra_pages
    order = torch.randperm(total_pages, generator=g)
    page_indices = order[:seqs * pages_per_seq]
    tokens = sum(q_lens[:distribution[2]]) + padding
    cache = torch.randn(total_pages, page_size, 2 * kv_heads, d, generator=g).to(dtype)
    queries = torch.randn(tokens, q_heads, d, generator=g).to(q_dtype or dtype)
    keys = torch.randn(tokens, kv_heads, d, generator=g).to(dtype)
    values = torch.randn(tokens, kv_heads, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    return (queries, keys, values, cache, torch.tensor(kv_lens).to(index_dtype), page_indices.to(index_dtype),
            cu.to(index_dtype), torch.tensor(distribution).to(index_dtype))


def oracle(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *,
           use_causal_mask=True, sm_scale=None, sliding_window=None, soft_cap=None, mask_value=None,
           skip_kv_update=False, out_dtype=None):
    """(out float64, cache after the call, lse float64): one token at a time, straight from the spec."""
    cache = kv_cache.clone()
    total_pages, page_size, _, d = cache.shape
    q_heads, kv_heads = queries.shape[1], keys.shape[1]
    group = q_heads // kv_heads
    seqs = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // seqs
    scale = 1.0 if sm_scale is None else sm_scale
    out = torch.zeros(queries.shape, dtype=torch.float64)
    lse = torch.full(queries.shape[:2], -math.inf, dtype=torch.float64)
    active = int(distribution[2])
    table = page_indices.view(seqs, pages_per_seq).long()

    def slot(s, pos):
        return int(table[s, pos // page_size]), pos % page_size

    if not skip_kv_update:
        for s in range(active):
            q0, q1, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
            for i, t in enumerate(range(q0, q1)):
                page, offset = slot(s, kv_len - (q1 - q0) + i)
                cache[page, offset, 0::2] = keys[t]
                cache[page, offset, 1::2] = values[t]
    for s in range(active):
        q0, q1, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        if q1 == q0:
            continue
        rows = torch.stack([cache[slot(s, j)].double() for j in range(kv_len)])  # [kv_len, 2Hkv, D]
        k, v = rows[:, 0::2].repeat_interleave(group, 1), rows[:, 1::2].repeat_interleave(group, 1)
        for i, t in enumerate(range(q0, q1)):
            pos = kv_len - (q1 - q0) + i
            logits = torch.einsum("hd,khd->hk", queries[t].double(), k) * scale
            if soft_cap is not None:
                logits = soft_cap * torch.tanh(logits / soft_cap)
            j = torch.arange(kv_len)
            visible = torch.ones(kv_len, dtype=torch.bool)
            if use_causal_mask:
                visible &= j <= pos
            if sliding_window is not None:
                visible &= j > pos - sliding_window
            logits = logits.masked_fill(~visible, -math.inf if mask_value is None else mask_value)
            lse[t] = torch.logsumexp(logits, -1)
            out[t] = torch.einsum("hk,khd->hd", torch.softmax(logits, -1), v)
    return out, cache, lse


def bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                                    b.contiguous().view(-1).view(torch.uint8))


def check(impl, args, options=None, tol=None, configs=None):
    options = options or {}
    args = tuple(a.clone() for a in args)
    want_out, want_cache, want_lse = oracle(*args, **options)
    cache = args[3]
    out, returned, lse = impl(*args, return_lse=True, configs=configs, **options)
    assert returned is cache
    assert bits_equal(cache, want_cache.to(cache.dtype))
    assert out.dtype == (options.get("out_dtype") or args[0].dtype)
    tol = tol or max(TOLERANCE[args[0].dtype], TOLERANCE[cache.dtype])
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)


OPTIONS = {
    "plain": {},
    "scaled": {"sm_scale": 0.25},
    "no-causal": {"use_causal_mask": False},
    "window": {"sliding_window": 3},
    "soft-cap": {"soft_cap": 2.0, "sm_scale": 0.5},
    "mask-value": {"mask_value": -3.0, "sliding_window": 4},
    "skip-update": {"skip_kv_update": True},
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl,num_threads", [(rpa.reference, None)] + [(rpa.kernel, n) for n in THREAD_COUNTS],
                         indirect=["num_threads"])
def test_matches_float64_oracle(impl, num_threads, dtype, options):
    check(impl, problem(dtype=dtype), options)


def with_fields(args, **fields):
    """The heuristic forward config of the call with `fields` changed, as configs=."""
    base = rpa.kernel.get_configs(*args)[0]
    return rpa.Config(**{**base.__dict__, **fields}), None


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_threads", [1, 3], indirect=True)
def test_gemm_path_matches_float64_oracle(num_threads, dtype, options):
    # Every sequence of at least 2 tokens on dot_product_attention's kernel, the decodes on the rows.
    args = problem(dtype=dtype)
    check(rpa.kernel, args, options, configs=with_fields(args, gemm_min_tokens=2))


@pytest.mark.parametrize("impl", [rpa.reference, rpa.kernel], ids=["reference", "kernel"])
def test_gqa_long_sequences_int64_and_mixed_dtypes(impl):
    # Group 8 (more than one 8-row product), D = 64, pages of 16, decode and prefill and mixed.
    args = problem(q_lens=(1, 1, 40, 70), kv_lens=(150, 33, 40, 190), distribution=(2, 3, 4), pages_per_seq=13,
                   page_size=16, q_heads=16, kv_heads=2, d=64, index_dtype=torch.int64)
    check(impl, args, {"sliding_window": 50})
    check(impl, problem(dtype=torch.bfloat16, q_dtype=torch.float32), {"out_dtype": torch.float16}, tol=2e-2)


@pytest.mark.parametrize("config", rpa.kernel.config_space(*problem(q_lens=(1, 1, 40), kv_lens=(900, 300, 700),
                                                                    pages_per_seq=60, page_size=16, d=32)),
                         ids=str)
def test_every_config_of_the_space_matches_the_oracle(config):
    args = problem(q_lens=(1, 1, 40), kv_lens=(900, 300, 700), pages_per_seq=60, page_size=16, d=32)
    check(rpa.kernel, args, {"sliding_window": 600})
    check(rpa.kernel, args)


def test_bits_do_not_depend_on_task_shape():
    # q_tile_tokens and task_rows regroup rows into tasks; the bits stay (block_kv, split_kv fixed).
    args = problem(q_lens=(1, 37, 5), kv_lens=(300, 100, 64), pages_per_seq=20, page_size=16, q_heads=8, kv_heads=2)
    results = []
    for q_tile, rows in ((32, 128), (1, 1), (7, 30), (64, 8192)):
        configs = with_fields(args, q_tile_tokens=q_tile, task_rows=rows, gemm_min_tokens=0)
        results.append(rpa.kernel(*(a.clone() for a in args), return_lse=True, configs=configs))
    for out, _, lse in results[1:]:
        assert bits_equal(out, results[0][0]) and bits_equal(lse, results[0][2])


@pytest.mark.parametrize("strided_cache", [False, True], ids=["contiguous-cache", "strided-cache"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 40, "soft_cap": 3.0}, {"mask_value": -5.0}],
                         ids=["plain", "window-soft-cap", "mask-value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_threads", [1, 3], indirect=True)
def test_staged_rows_change_no_bits(num_threads, dtype, options, strided_cache):
    # stage_rows copies each tile's rows before the passes read them: every task staged (8192) or
    # none (0) gives the same bits, on a cache whose merged heads are adjacent (one copy per token
    # row) and on one whose are not (a copy per head row); decode tiles cross 16-token pages.
    args = problem(q_lens=(1, 1, 5, 3), kv_lens=(300, 70, 41, 90), pages_per_seq=19, page_size=16, q_heads=8,
                   kv_heads=2, d=32, dtype=dtype)
    if strided_cache:
        padded = torch.full((*args[3].shape[:3], 2 * args[3].shape[3]), float("nan"), dtype=dtype)
        padded[..., :32] = args[3]
    results = []
    for stage_rows in (0, 8192, 8):
        fresh = tuple(a.clone() for a in args)
        if strided_cache:  # clone() of a strided view is contiguous: keep the padded strides
            fresh = (*fresh[:3], padded.clone()[..., :32], *fresh[4:])
            assert fresh[3].stride(2) == 64
        configs = with_fields(args, stage_rows=stage_rows, gemm_min_tokens=0)
        out, cache, lse = rpa.kernel(*fresh, return_lse=True, configs=configs, **options)
        results.append((out, cache, lse))
    for out, cache, lse in results[1:]:
        assert bits_equal(out, results[0][0]) and bits_equal(lse, results[0][2])
        assert bits_equal(cache, results[0][1])
    want_out, _, want_lse = oracle(*(a.clone() for a in args), **options)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(results[1][0].double(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(results[1][2].double(), want_lse, rtol=tol, atol=tol)


def test_padding_tokens_and_inactive_sequences_are_untouched():
    # Sequence 2 is inactive (distribution[2] = 2): its token is padding, its pages keep their bits.
    args = problem(q_lens=(1, 4, 2), kv_lens=(5, 9, 6), distribution=(1, 1, 2), padding=3)
    before = args[3].clone()
    out, cache, lse = rpa.kernel(*args, return_lse=True)
    assert (out[5:] == 0).all() and (lse[5:] == -math.inf).all()
    pages = args[5].view(3, -1)[2].long()
    assert bits_equal(cache[pages], before[pages])


@pytest.mark.parametrize("split_kv", [0, 32])  # the decode sequence whole, and split and merged
def test_a_nan_query_gives_nan_not_a_masked_row(split_kv):
    # A NaN logit makes that row NaN (output and lse), as in the reference; it must not pass for
    # a row that sees no key (0 and -inf), and the other rows keep finite results.
    args = list(problem(q_lens=(1, 4, 2), kv_lens=(90, 9, 6), pages_per_seq=6, page_size=16, padding=3))
    args[0] = args[0].clone()
    args[0][0, 1, 0] = math.nan  # the decode sequence, query head 1
    args[0][3, 0, 0] = math.nan  # a prefill token, query head 0
    configs = with_fields(args, split_kv=split_kv) if split_kv else None
    out, _, lse = rpa.kernel(*args, return_lse=True, configs=configs)
    assert out[0, 1].isnan().all() and lse[0, 1].isnan() and out[3, 0].isnan().all() and lse[3, 0].isnan()
    finite = torch.ones(out.shape[:2], dtype=torch.bool)
    finite[0, 1] = finite[3, 0] = False
    finite[7:] = False  # padding tokens
    assert out[finite].isfinite().all() and lse[finite].isfinite().all()


def test_empty_batch():
    args = problem(q_lens=(0,), kv_lens=(0,), distribution=(0, 0, 0), padding=0)
    out, cache = rpa.kernel(*args)
    assert out.shape == (0, 4, 16) and cache is args[3]


def test_a_decode_step_compiles_without_copying_the_cache():
    # The cache as a module buffer, as a server holds it.
    class Layer(torch.nn.Module):
        def __init__(self, cache):
            super().__init__()
            self.register_buffer("cache", cache)

        def forward(self, q, k, v, kv_lens, pages, cu, dist):
            out, _ = rpa.kernel(q, k, v, self.cache, kv_lens, pages, cu, dist)
            return out

    args = problem(q_lens=(1, 1, 1), kv_lens=(9, 3, 17))
    eager, compiled = Layer(args[3].clone()), Layer(args[3].clone())
    want = eager(args[0], args[1], args[2], *args[4:])
    ptr = compiled.cache.data_ptr()
    got, codes = run_and_get_code(torch.compile(compiled, fullgraph=True), args[0], args[1], args[2], *args[4:])
    assert bits_equal(got, want) and bits_equal(compiled.cache, eager.cache) and compiled.cache.data_ptr() == ptr
    assert not copies_in_code(codes, [compiled.cache]), copies_in_code(codes, [compiled.cache])


def test_a_new_sequence_count_does_not_recompile():
    # The op adds no guard on S (kv_lens [S], page_indices [S * pages_per_seq], cu_q_lens [S + 1]):
    # one graph for S = 2..9, T and the page count varying too. Duck sizing is off because it is
    # Dynamo's, not the op's: at trace time it gives equal sizes one symbol and guards that they
    # stay equal, so S = 2 beside Hkv = 2, S + 1 = 3 beside distribution's [3], or a decode
    # step's T = S recompile at the next S whatever the op does (docs/design.md, "Buffer donation";
    # a server pads its batch or marks such tensors static, as examples/serve_demo.py does).
    # S = 1 is left out: Dynamo specializes sizes 0 and 1 itself.
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda *a: rpa.kernel(*a), backend=counter, fullgraph=True, dynamic=True)
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        for seqs in (2, 3, 5, 9):
            q_lens = (1,) * (seqs - 1) + (5,)
            args = problem(q_lens=q_lens, kv_lens=tuple(range(10, 9 + seqs)) + (17,), pages_per_seq=7,
                           page_size=4, extra_pages=1, seed=seqs)
            cache = args[3].clone()
            want, want_cache = rpa.kernel(*args[:3], cache, *args[4:])
            got, got_cache = compiled(*args)
            assert bits_equal(got, want) and bits_equal(got_cache, want_cache), f"S = {seqs}"
    assert counter.frame_count == 1, "one graph for every sequence count"


# ---- the contract ----------------------------------------------------------------------------

def _sample(options=None, **kwargs):
    return lambda: (problem(**kwargs), dict(options or {}))


def _bad_inputs():
    q, k, v, cache, kv_lens, pages, cu, dist = problem()
    i32 = torch.int32
    shared = torch.randn(*cache.shape)
    return [
        BadInput(r"queries must be 3-D \[T, Hq, D\]", (q[0], k, v, cache, kv_lens, pages, cu, dist)),
        BadInput(r"kv_cache must be 4-D \[total_pages, page_size, 2\*Hkv, D\]",
                 (q, k, v, cache[0], kv_lens, pages, cu, dist)),
        BadInput(r"the query heads Hq = 3 must be a multiple of the kv heads Hkv = 2",
                 (q[:, :3], k, v, cache, kv_lens, pages, cu, dist)),
        BadInput(r"kv_cache.shape\[2\] must be 2\*Hkv = 4", (q, k, v, cache[:, :, :2], kv_lens, pages, cu, dist)),
        BadInput(r"kv_cache.shape\[3\] must be D = 16", (q, k, v, cache[..., :8], kv_lens, pages, cu, dist)),
        BadInput("keys must have kv_cache's dtype Float, got Half", (q, k.half(), v, cache, kv_lens, pages, cu, dist)),
        BadInput("queries must be float32, bfloat16 or float16, got Double",
                 (q.double(), k, v, cache, kv_lens, pages, cu, dist)),
        BadInput("kv_lens must be int32 or int64, got Float", (q, k, v, cache, kv_lens.float(), pages, cu, dist)),
        BadInput(r"cu_q_lens must be \[S \+ 1\] = \[5\]", (q, k, v, cache, kv_lens, pages, cu[:4], dist)),
        BadInput(r"page_indices must be \[S \* pages_per_seq\]", (q, k, v, cache, kv_lens, pages[:-1], cu, dist)),
        BadInput(r"kv_cache must have a contiguous last dimension",
                 (q, k, v, torch.randn(*cache.shape[:3], 32)[..., ::2], kv_lens, pages, cu, dist)),
        BadInput("sliding_window must be at least 1, got 0", (q, k, v, cache, kv_lens, pages, cu, dist),
                 {"sliding_window": 0}),
        BadInput("soft_cap must be a positive finite number", (q, k, v, cache, kv_lens, pages, cu, dist),
                 {"soft_cap": -1.0}),
        BadInput("soft_cap must be a positive finite number, got inf", (q, k, v, cache, kv_lens, pages, cu, dist),
                 {"soft_cap": math.inf}),
        BadInput("sm_scale must be finite, got nan", (q, k, v, cache, kv_lens, pages, cu, dist), {"sm_scale": math.nan}),
        BadInput("sm_scale must be finite, got inf", (q, k, v, cache, kv_lens, pages, cu, dist), {"sm_scale": math.inf}),
        BadInput("mask_value must be finite or -inf, got inf", (q, k, v, cache, kv_lens, pages, cu, dist),
                 {"mask_value": math.inf}),
        BadInput("mask_value must be finite or -inf, got nan", (q, k, v, cache, kv_lens, pages, cu, dist),
                 {"mask_value": math.nan}),
        # Pages of no token: the sequences must have none either (an all-zero kv_lens).
        BadInput(r"kv_cache.shape\[1\] \(page_size\) must be at least 1, got kv_cache shape \[27, 0, 4, 16\]",
                 (q, k, v, cache[:, :0], kv_lens * 0, pages, cu, dist)),
        BadInput(r"page_indices\[7\] \(page 1 of sequence 1\) must be in \[0, total_pages = 27\), got 27",
                 (q, k, v, cache, kv_lens, pages.index_put((torch.tensor(7),), torch.tensor(27, dtype=i32)), cu,
                  dist)),
        BadInput(r"page_indices\[0\] \(page 0 of sequence 0\) must be in \[0, total_pages = 27\), got -1",
                 (q, k, v, cache, kv_lens, pages.index_put((torch.tensor(0),), torch.tensor(-1, dtype=i32)), cu,
                  dist)),
        BadInput(r"kv_lens\[3\] must be in \[q_len, pages_per_seq \* page_size\] = \[3, 24\]",
                 (q, k, v, cache, torch.tensor([7, 20, 9, 2], dtype=i32), pages, cu, dist)),
        BadInput(r"kv_lens\[1\] must be in \[q_len, pages_per_seq \* page_size\] = \[1, 24\].*got 25",
                 (q, k, v, cache, torch.tensor([7, 25, 9, 3], dtype=i32), pages, cu, dist)),
        BadInput(r"cu_q_lens must be non-decreasing over the 4 active sequences, got cu_q_lens\[2\] = 7 > "
                 r"cu_q_lens\[3\] = 2", (q, k, v, cache, kv_lens, pages, torch.tensor([0, 1, 7, 2, 10], dtype=i32),
                                         dist)),
        BadInput(r"cu_q_lens\[0\] must be 0, got 1",
                 (q, k, v, cache, kv_lens, pages, torch.tensor([1, 1, 2, 7, 10], dtype=i32), dist)),
        BadInput(r"must be at most the number of tokens T = 12, got 13",
                 (q, k, v, cache, torch.tensor([7, 20, 9, 6], dtype=i32), pages,
                  torch.tensor([0, 1, 2, 7, 13], dtype=i32), dist)),
        BadInput(r"distribution must be the cumulative sequence counts .* got \[2, 1, 4\]",
                 (q, k, v, cache, kv_lens, pages, cu, torch.tensor([2, 1, 4], dtype=i32))),
        BadInput(r"distribution must be the cumulative sequence counts .* S = 4, got \[0, 0, 5\]",
                 (q, k, v, cache, kv_lens, pages, cu, torch.tensor([0, 0, 5], dtype=i32))),
        BadInput(r"decode sequence 2 \(s < distribution\[0\] = 3\) must have 1 query token, got 5",
                 (q, k, v, cache, kv_lens, pages, cu, torch.tensor([3, 3, 4], dtype=i32))),
        BadInput("must not repeat a slot",  # two sequences sharing the page their new tokens go to
                 (q, k, v, cache, kv_lens, pages.index_put((torch.tensor(12 + 1),), pages[1]), cu, dist)),
        BadInput("kv_cache is written in place and must not overlap itself",
                 (q, k, v, torch.randn(1, *cache.shape[1:]).expand(*cache.shape), kv_lens, pages, cu, dist)),
        BadInput("keys must not share memory with kv_cache",
                 (q, shared.view(-1)[:12 * 2 * 16].view(12, 2, 16), v, shared, kv_lens, pages, cu, dist)),
    ]


def _donation_call(nbytes):
    """A bf16 cache of about `nbytes` (pages of 16 tokens x 8 kv heads x 2 x 128 x 2 bytes), every
    page touched, and a decode step of 64 sequences of 512 cached tokens."""
    page_bytes = 16 * 16 * 128 * 2
    pages = max(64 * 32, nbytes // page_bytes)
    cache = torch.ones(pages, 16, 16, 128, dtype=torch.bfloat16)
    seqs = 64
    queries = torch.randn(seqs, 32, 128).to(torch.bfloat16)
    keys = torch.randn(seqs, 8, 128).to(torch.bfloat16)
    values = torch.randn(seqs, 8, 128).to(torch.bfloat16)
    page_indices = (torch.arange(seqs * 32) * (pages // (seqs * 32))).to(torch.int32)
    return (queries, keys, values, cache, torch.full((seqs,), 512, dtype=torch.int32), page_indices,
            torch.arange(seqs + 1, dtype=torch.int32), torch.tensor([seqs, seqs, seqs], dtype=torch.int32)), {}


def _dynamic(t):
    """t tokens: one decode sequence, one prefill of t - 3 tokens, 2 padding tokens."""
    return problem(q_lens=(1, t - 3), kv_lens=(14, t - 1), pages_per_seq=7, page_size=4, padding=2,
                   extra_pages=1), {}


CONTRACT = OpContract(
    name="ragged_paged_attention",
    reference=rpa.reference,
    kernel=rpa.kernel,
    samples=[
        Sample("fp32", _sample()),
        Sample("bf16-window-softcap", _sample({"sliding_window": 5, "soft_cap": 3.0}, dtype=torch.bfloat16)),
        Sample("fp16-mask-value-no-causal", _sample({"use_causal_mask": False, "mask_value": -2.0, "sm_scale": 0.3},
                                                    dtype=torch.float16, index_dtype=torch.int64), compile=False),
        Sample("skip-update-lse", _sample({"skip_kv_update": True, "return_lse": True}), compile=False),
    ],
    bad_inputs=_bad_inputs,
    invalid_configs=[
        ("expected 6 values", ([8], None)),
        ("config: ragged_paged_attention config: block_kv must be", ([4, 32, 128, 0, 32, 4], None)),
        ("split_kv must be a multiple of block_kv", ([64, 32, 128, 96, 32, 4], None)),
    ],
    config_samples={"forward": Sample("decode-and-prefill", _sample(q_lens=(1, 1, 40), kv_lens=(900, 300, 700),
                                                                     pages_per_seq=60, page_size=16, d=32))},
    # T symbolic; its sizes differ from Hq 4, Hkv 2, page_size 4, D 16, S 2, the 15 pages, pages_per_seq 7.
    dynamic=[DynamicSizes("tokens", _dynamic, [{"t": 9}, {"t": 13}, {"t": 19}], {"t": (6, 29)},
                          lambda dims: ({0: dims["t"]}, {0: dims["t"]}, {0: dims["t"]}, None, None, None, None,
                                        None))],
    determinism_samples=[
        Sample("decode", _sample(q_lens=(1,) * 6, kv_lens=(3000, 1000, 2500, 64, 700, 1900), pages_per_seq=200,
                                 page_size=16, q_heads=8, kv_heads=2, d=64, dtype=torch.bfloat16, extra_pages=0)),
        Sample("prefill", _sample(q_lens=(300, 70), kv_lens=(400, 90), pages_per_seq=26, page_size=16, q_heads=8,
                                  kv_heads=4, d=32)),
    ],
    donation_call=_donation_call,
)


# ---- property test -----------------------------------------------------------------------------

@st.composite
def rpa_problems(draw):
    dtype = draw(st.sampled_from(DTYPES))
    kv_heads = draw(st.integers(1, 3), label="kv_heads")
    group = draw(st.sampled_from([1, 2, 5, 9]), label="group")
    seqs = draw(st.integers(1, 4), label="seqs")
    page_size = draw(st.sampled_from([1, 3, 8]), label="page_size")
    q_lens, kv_lens = [], []
    for s in range(seqs):
        q_len = draw(st.integers(0, 12), label="q_len")
        q_lens.append(q_len)
        kv_lens.append(q_len + draw(st.integers(0, 30), label="cached"))
    pages_per_seq = max(1, max(-(-k // page_size) for k in kv_lens))
    decode = 0
    while decode < seqs and q_lens[decode] == 1:
        decode += 1
    active = draw(st.integers(0, seqs), label="active")
    dist = (min(decode, active), min(decode, active), active)
    options = draw(st.sampled_from(list(OPTIONS.values())))
    args = problem(tuple(q_lens), tuple(kv_lens), dist, pages_per_seq, page_size, kv_heads * group, kv_heads,
                   draw(st.sampled_from([1, 8, 32, 40])), dtype, padding=draw(st.integers(0, 2)),
                   seed=draw(st.integers(0, 2**31 - 1)))
    return args, options, draw(st.sampled_from([None, 0, 1, 5]), label="gemm_min_tokens")


@settings(PROFILE, max_examples=120)
@given(problem=rpa_problems())
def ragged_paged_attention_kernel_matches_float64_oracle(problem):
    args, options, gemm_min_tokens = problem
    configs = None if gemm_min_tokens is None else with_fields(args, gemm_min_tokens=gemm_min_tokens)
    check(rpa.kernel, args, options, configs=configs)


PROPERTIES = [ragged_paged_attention_kernel_matches_float64_oracle]
