"""router_topk: its contract samples, the upstream algorithm as the oracle (k arg-max passes),
upstream's special cases (NaN / -inf / -FLT_MAX rows, ties, plateaus) and its property test."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import DTYPES, PROFILE, layout
from tokamax_torch.ops import router_topk as rt

FLOOR = torch.tensor(-3.0e38, dtype=torch.float32).item()  # upstream's clamp value, as fp32
NAN, INF, FLT_MAX = float("nan"), float("inf"), torch.finfo(torch.float32).max


def oracle(scores, k):
    """Upstream's reference.rowmax_topk, pass by pass: clamp NaN and <= -3e38 to -3e38, then k
    times take the max and its lowest column; a row whose first weight is the floor is NaN."""
    cur = scores.float()
    cur = torch.where(cur > FLOOR, cur, torch.full_like(cur, FLOOR))
    weights, ids = [], []
    for _ in range(k):
        best = cur.max(1, keepdim=True).values
        idx = (cur == best).int().argmax(1, keepdim=True)  # argmax: the first maximal column
        weights.append(best)
        ids.append(idx)
        cur = cur.scatter(1, idx, -INF)
    weights, ids = torch.cat(weights, 1), torch.cat(ids, 1).int()
    if weights.numel():
        weights = torch.where(weights[:, :1] <= FLOOR, torch.full_like(weights, NAN), weights)
    return weights, ids


def assert_matches_oracle(scores, k, got):
    want_w, want_i = oracle(scores, k)
    weights, indices = got
    assert weights.dtype == torch.float32 and indices.dtype == torch.int32
    assert torch.equal(indices, want_i), f"indices\n{indices}\nwant\n{want_i}"
    torch.testing.assert_close(weights, want_w, rtol=0, atol=0, equal_nan=True)


def special_scores(rows, cols, dtype=torch.float32, seed=0, bad_rows=True):
    """Few distinct values (many ties), and rows with NaN, -inf, -FLT_MAX, +inf, or (bad_rows)
    nothing good."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.randint(-6, 7, (rows, cols), generator=g) * 0.25).float()
    specials = torch.tensor([NAN, -INF, -FLT_MAX, INF, -3.1e38, FLOOR])
    pick = torch.randint(0, 6, (rows, cols), generator=g)
    sprinkle = torch.rand(rows, cols, generator=g) < 0.15
    s = torch.where(sprinkle & (torch.arange(rows)[:, None] % 3 == 1), specials[pick], s)
    bad = (torch.arange(rows) % 7 == 5) & bad_rows
    s[bad] = specials[pick[bad] % 3]  # rows with no good score
    return s.to(dtype)


IMPLS = [(rt.reference, None)] + [(rt.kernel, n) for n in THREAD_COUNTS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl,num_threads", IMPLS, indirect=["num_threads"])
@pytest.mark.parametrize("rows,cols,k", [(40, 256, 8), (33, 100, 7), (16, 64, 1), (8, 16, 16), (300, 384, 6)])
def test_matches_upstream_algorithm(impl, num_threads, dtype, rows, cols, k):
    s = special_scores(rows, cols, dtype, seed=rows * cols + k)
    assert_matches_oracle(s, k, impl(s, k))
    t = special_scores(cols, rows, dtype, seed=k).t()  # strided rows
    assert_matches_oracle(t, k, impl(t, k))


@pytest.mark.parametrize("impl", [rt.reference, rt.kernel], ids=["reference", "kernel"])
def test_upstream_special_rows(impl):
    s = torch.rand(6, 512)
    s[0] = NAN
    s[1] = -INF
    s[2] = -FLT_MAX
    s[3] = 1.0  # all equal: ids 0..9
    s[4, 200:212] = 4.0  # a plateau: ids 200..209
    s[5, :5] = NAN  # partial NaN: finite weights, ids >= 5
    weights, indices = impl(s, 10)
    for r in range(3):
        assert weights[r].isnan().all() and indices[r].tolist() == list(range(10))
    assert indices[3].tolist() == list(range(10)) and (weights[3] == 1.0).all()
    assert indices[4].tolist() == list(range(200, 210)) and (weights[4] == 4.0).all()
    assert weights[5].isfinite().all() and (indices[5] >= 5).all()


@pytest.mark.parametrize("impl", [rt.reference, rt.kernel], ids=["reference", "kernel"])
def test_short_row_is_filled_with_the_lowest_unselected_ids_at_the_floor(impl):
    s = torch.tensor([[NAN, -INF, 2.0, -FLT_MAX, 1.0, NAN]])
    weights, indices = impl(s, 5)
    assert indices.tolist() == [[2, 4, 0, 1, 3]]
    assert weights.tolist() == [[2.0, 1.0, FLOOR, FLOOR, FLOOR]]


@pytest.mark.parametrize("impl", [rt.reference, rt.kernel], ids=["reference", "kernel"])
def test_weights_are_the_raw_scores_and_equal_torch_topk_values(impl):
    probs = torch.randn(64, 128).softmax(-1)  # upstream's check: softmaxed routing scores
    weights, indices = impl(probs, 8)
    assert torch.equal(weights, torch.topk(probs, 8).values)
    assert torch.equal(weights, probs.gather(1, indices.long()))


@pytest.mark.parametrize("impl", [rt.reference, rt.kernel], ids=["reference", "kernel"])
def test_no_gradient_and_empty_rows(impl):
    s = torch.randn(5, 16, requires_grad=True)
    weights, indices = impl(s, 4)
    assert not weights.requires_grad and not indices.requires_grad  # upstream defines no gradient
    weights, indices = impl(torch.empty(0, 16), 3)
    assert weights.shape == (0, 3) and indices.shape == (0, 3)


def _sample(rows, cols, k, dtype=torch.float32, transposed=False):
    # No all-bad rows: opcheck compares outputs without equal_nan, and their weights are NaN.
    def make():
        s = special_scores(cols, rows, dtype, bad_rows=False).t() if transposed else special_scores(rows, cols, dtype, bad_rows=False)
        return (s, k), {}
    return make


CONTRACT = OpContract(
    name="router_topk",
    reference=rt.reference,
    kernel=rt.kernel,
    samples=[
        Sample("fp32", _sample(12, 64, 8)),
        Sample("bf16", _sample(9, 40, 5, torch.bfloat16), compile=False),
        Sample("fp16-transposed", _sample(7, 33, 3, torch.float16, transposed=True)),
    ],
    bad_inputs=lambda: [
        BadInput(r"router_topk: scores must be 2-D \[T, E\], got shape \[4\]", (torch.randn(4), 2)),
        BadInput("router_topk: scores must be float32, bfloat16 or float16, got Int",
                 (torch.ones(2, 3, dtype=torch.int32), 2)),
        BadInput("router_topk: scores must be float32, bfloat16 or float16, got Double",
                 (torch.ones(2, 3, dtype=torch.float64), 2)),
        BadInput(r"router_topk: k must be in \[1, E=3\], got 4", (torch.randn(2, 3), 4)),
        BadInput(r"router_topk: k must be in \[1, E=3\], got 0", (torch.randn(2, 3), 0)),
    ],
    dynamic=[DynamicSizes("tokens", lambda t: ((torch.randn(t, 48),), {"k": 6}), [{"t": 5}, {"t": 9}, {"t": 17}],
                          {"t": (2, 4096)}, lambda dims: ({0: dims["t"]},), export_only_sizes=[{"t": 1}])],
    determinism_samples=[Sample("many-rows", _sample(4096, 128, 8))],
)


@st.composite
def router_topk_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    cols = draw(st.integers(1, 300), label="E")
    shape = (draw(st.integers(0, 40), label="T"), cols)
    k = draw(st.integers(1, min(cols, 40)), label="k")
    scores = layout(draw, shape, generator, dtype, "scores")
    if draw(st.booleans(), label="specials") and scores.numel():
        scores = scores.clone()
        mask = torch.rand(shape, generator=generator) < 0.2
        scores[mask] = torch.tensor([NAN, -INF, -FLT_MAX, INF])[torch.randint(0, 4, shape, generator=generator)][mask].to(dtype)
    if draw(st.booleans(), label="ties"):
        scores = (scores.float() * 2).round().to(dtype)
    return scores, k


@settings(PROFILE, max_examples=150)
@given(problem=router_topk_problems())
def router_topk_kernel_matches_upstream_algorithm(problem):
    scores, k = problem
    assert_matches_oracle(scores, k, rt.kernel(scores, k))


PROPERTIES = [router_topk_kernel_matches_upstream_algorithm]
