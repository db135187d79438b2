"""topk: its contract samples, upstream's masked top_k as the oracle (k arg-max passes), upstream's
test contract (-1 suffix, live indices < row length and unique, exact values), ragged rows and
its property test."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import DTYPES, PROFILE, layout
from tokamax_torch.ops import topk as tk

NAN, INF = float("nan"), float("inf")


def oracle(scores, k, row_lengths=None):
    """Upstream's reference: eligible = column < clamp(row_length, 0, n) and score > -inf; top_k
    on the masked scores by k arg-max passes (ties: the first column); -1 where the value is -inf."""
    s = scores.float()
    b, n = s.shape
    length = torch.full((b,), n) if row_lengths is None else row_lengths.long().clamp(0, n)
    eligible = (torch.arange(n)[None, :] < length[:, None]) & (s > -INF)
    cur = torch.where(eligible, s, torch.full_like(s, -INF))
    values, ids = [], []
    for _ in range(k):
        best = cur.max(1, keepdim=True).values if n else torch.full((b, 1), -INF)
        idx = (cur == best).int().argmax(1, keepdim=True)
        ids.append(torch.where(best == -INF, torch.full_like(idx, -1), idx))
        values.append(best)
        cur = cur.scatter(1, idx, -INF)
    return torch.cat(ids, 1).int(), torch.cat(values, 1).to(scores.dtype)


def assert_matches_oracle(scores, k, row_lengths, got, return_scores=True):
    want_i, want_v = oracle(scores, k, row_lengths)
    indices, values = got
    assert indices.dtype == torch.int32 and torch.equal(indices, want_i), f"indices\n{indices}\nwant\n{want_i}"
    if return_scores:
        assert values.dtype == scores.dtype
        torch.testing.assert_close(values, want_v, rtol=0, atol=0)
    else:
        assert values is None


def ragged_scores(rows, cols, dtype=torch.float32, seed=0):
    """Integer-valued scores (ties) with some -inf and NaN, and lengths from -1 to n + 1."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-5, 6, (rows, cols), generator=g).float()
    s[torch.rand(rows, cols, generator=g) < 0.1] = -INF
    s[torch.rand(rows, cols, generator=g) < 0.05] = NAN
    lengths = torch.randint(-1, cols + 2, (rows,), generator=g, dtype=torch.int32)
    return s.to(dtype), lengths


IMPLS = [(tk.reference, None)] + [(tk.kernel, n) for n in THREAD_COUNTS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl,num_threads", IMPLS, indirect=["num_threads"])
@pytest.mark.parametrize("rows,cols,k", [(4, 256, 16), (32, 300, 17), (5, 64, 64), (3, 10, 1)])
def test_matches_upstream_algorithm(impl, num_threads, dtype, rows, cols, k):
    s, lengths = ragged_scores(rows, cols, dtype, seed=rows + cols + k)
    for row_lengths in (None, lengths):
        assert_matches_oracle(s, k, row_lengths, impl(s, k, row_lengths=row_lengths, return_scores=True))
        assert_matches_oracle(s, k, row_lengths, impl(s, k, row_lengths=row_lengths), return_scores=False)
    t = ragged_scores(cols, rows, dtype, seed=k)[0].t()  # strided rows
    assert_matches_oracle(t, k, lengths, impl(t, k, row_lengths=lengths, return_scores=True))


@pytest.mark.parametrize("impl", [tk.reference, tk.kernel], ids=["reference", "kernel"])
def test_upstream_contract_on_ragged_rows(impl):
    """Lengths 0, k/2, k and n/2; -1 only as a suffix; live ids < length and unique; the live
    values equal the scores at those ids; padded values are -inf."""
    b, n, k = 4, 128, 16
    s = torch.randn(b, n)
    lengths = torch.tensor([0, k // 2, k, n // 2], dtype=torch.int32)
    indices, values = impl(s, k, row_lengths=lengths, return_scores=True)
    for r in range(b):
        live = indices[r][indices[r] >= 0]
        assert len(live) == min(int(lengths[r]), k)
        assert (indices[r][len(live):] == -1).all(), "-1 only as a suffix"
        assert (live < lengths[r]).all() and len(set(live.tolist())) == len(live)
        assert torch.equal(values[r][:len(live)], s[r][live.long()])
        assert (values[r][len(live):] == -INF).all()
        assert torch.equal(values[r][:len(live)], s[r][:int(lengths[r])].topk(len(live)).values)


@pytest.mark.parametrize("impl", [tk.reference, tk.kernel], ids=["reference", "kernel"])
def test_ties_go_to_the_lower_index_and_nan_never_selected(impl):
    s = torch.tensor([[1.0, NAN, 3.0, 3.0, -INF, 1.0, 3.0]])
    indices, values = impl(s, 6, return_scores=True)
    assert indices.tolist() == [[2, 3, 6, 0, 5, -1]]
    assert values.tolist() == [[3.0, 3.0, 3.0, 1.0, 1.0, -INF]]


@pytest.mark.parametrize("impl", [tk.reference, tk.kernel], ids=["reference", "kernel"])
def test_no_gradient_and_empty_batch(impl):
    indices, values = impl(torch.randn(3, 8, requires_grad=True), 2, return_scores=True)
    assert not values.requires_grad
    indices, values = impl(torch.empty(0, 8), 3, return_scores=True)
    assert indices.shape == (0, 3) and values.shape == (0, 3)


def _sample(rows, cols, k, dtype=torch.float32, ragged=True, return_scores=True, transposed=False):
    def make():
        s, lengths = ragged_scores(cols, rows, dtype) if transposed else ragged_scores(rows, cols, dtype)
        s = s.t() if transposed else s
        if transposed:
            lengths = ragged_scores(rows, cols, dtype)[1]
        return (s, k), {"row_lengths": lengths if ragged else None, "return_scores": return_scores}
    return make


CONTRACT = OpContract(
    name="topk",
    reference=tk.reference,
    kernel=tk.kernel,
    samples=[
        Sample("fp32-ragged", _sample(6, 64, 8)),
        Sample("bf16-full", _sample(5, 40, 5, torch.bfloat16, ragged=False), compile=False),
        Sample("fp16-indices-only", _sample(7, 33, 3, torch.float16, return_scores=False, transposed=True)),
    ],
    bad_inputs=lambda: [
        BadInput(r"topk: scores must be 2-D \[b, n\], got shape \[4\]", (torch.randn(4), 2)),
        BadInput("topk: scores must be float32, bfloat16 or float16, got Int", (torch.ones(2, 3, dtype=torch.int32), 2)),
        BadInput(r"topk: k must be in \[1, n=3\], got 4", (torch.randn(2, 3), 4)),
        BadInput(r"topk: k must be in \[1, n=3\], got 0", (torch.randn(2, 3), 0)),
        BadInput(r"topk: row_lengths must be int32 \[b\], got Long\[2\]", (torch.randn(2, 3), 2),
                 {"row_lengths": torch.ones(2, dtype=torch.long)}),
        BadInput(r"topk: row_lengths must have b=2 entries, got shape \[3\]", (torch.randn(2, 3), 2),
                 {"row_lengths": torch.ones(3, dtype=torch.int32)}),
    ],
    dynamic=[DynamicSizes("rows-cols", lambda b, n: ((torch.randn(b, n), 6, torch.full((b,), n // 2, dtype=torch.int32)),
                                                     {"return_scores": True}),
                          [{"b": 5, "n": 40}, {"b": 9, "n": 70}, {"b": 17, "n": 130}], {"b": (2, 4096), "n": (8, 4096)},
                          lambda dims: ({0: dims["b"], 1: dims["n"]}, None, {0: dims["b"]}))],
    determinism_samples=[Sample("many-rows", _sample(4096, 128, 8))],
)


@st.composite
def topk_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    cols = draw(st.integers(1, 300), label="n")
    rows = draw(st.integers(0, 40), label="b")
    k = draw(st.integers(1, min(cols, 40)), label="k")
    scores = layout(draw, (rows, cols), generator, dtype, "scores")
    if draw(st.booleans(), label="specials") and scores.numel():
        scores = scores.clone()
        mask = torch.rand(rows, cols, generator=generator) < 0.2
        scores[mask] = torch.tensor([NAN, -INF, INF])[torch.randint(0, 3, (rows, cols), generator=generator)][mask].to(dtype)
    if draw(st.booleans(), label="ties"):
        scores = (scores.float() * 2).round().to(dtype)
    row_lengths = None
    if draw(st.booleans(), label="ragged"):
        row_lengths = torch.randint(-2, cols + 3, (rows,), generator=generator, dtype=torch.int32)
    return scores, k, row_lengths, draw(st.booleans(), label="return_scores")


@settings(PROFILE, max_examples=150)
@given(problem=topk_problems())
def topk_kernel_matches_upstream_algorithm(problem):
    scores, k, row_lengths, return_scores = problem
    got = tk.kernel(scores, k, row_lengths=row_lengths, return_scores=return_scores)
    assert_matches_oracle(scores, k, row_lengths, got, return_scores)


PROPERTIES = [topk_kernel_matches_upstream_algorithm]
