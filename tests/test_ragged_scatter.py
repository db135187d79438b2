"""ragged_scatter: the oracles, errors and property test of tests/test_ragged_gather.py with the
rule on the index (start <= indices[j] < end) instead of the position, and its CONTRACT."""

import pytest
import torch
from hypothesis import given, settings

from contract import THREAD_COUNTS, DynamicSizes, OpContract, Sample
from strategies import PROFILE
from test_ragged_gather import ALL_DTYPES, bad_inputs, bits_equal, check_against_oracles, gather_problems, oracle, problem
from tokamax_torch.ops import ragged_scatter as rs

IMPLS = [(rs.reference, None)] + [(rs.kernel, n) for n in THREAD_COUNTS]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("impl,num_threads", IMPLS, indirect=["num_threads"])
def test_matches_oracles(impl, num_threads, dtype):
    # Repeated indices: dx sums several rows of dout per row of x.
    x, indices, start, end = problem(rows=9, hidden=700, n=40, start=2, end=7, dtype=dtype, by_index=True)
    x = torch.randn(700, 18).to(dtype).t()[::2]  # strided [9, 700]
    check_against_oracles(impl, True, dtype, (x, indices, start, end))


@pytest.mark.parametrize("impl", [rs.reference, rs.kernel], ids=["reference", "kernel"])
def test_rows_outside_the_range_are_zero(impl):
    x = torch.arange(12.0).view(4, 3)
    out = impl(x, torch.tensor([3, 0, 2, 1, 2]), torch.tensor([1]), torch.tensor([3]))
    assert torch.equal(out, torch.stack([torch.zeros(3), torch.zeros(3), x[2], x[1], x[2]]))


def _sample(**kwargs):
    def make():
        x, indices, start, end = problem(by_index=True, **{"start": 2, "end": 8, **kwargs})  # within R=10
        return (x.requires_grad_(True), indices, start, end), {}
    return make


CONTRACT = OpContract(
    name="ragged_scatter",
    reference=rs.reference,
    kernel=rs.kernel,
    samples=[
        Sample("fp32", _sample()),
        Sample("fp16-int64", _sample(dtype=torch.float16, index_dtype=torch.int64, bound_dtype=torch.int64),
               compile=False),
    ],
    bad_inputs=lambda: bad_inputs("ragged_scatter", True),
    # N symbolic; its sizes differ from R=40 and H=24.
    dynamic=[DynamicSizes("n", lambda n: (problem(rows=40, hidden=24, n=n, start=1, end=30, by_index=True), {}),
                          [{"n": 5}, {"n": 9}, {"n": 17}], {"n": (2, 4096)},
                          lambda dims: (None, {0: dims["n"]}, None, None))],
    determinism_samples=[Sample("many-rows", _sample(rows=3000, hidden=256, n=6000, start=100, end=2900))],
)


@settings(PROFILE, max_examples=100)
@given(problem=gather_problems(by_index=True))
def ragged_scatter_kernel_matches_oracle(problem):
    x, indices, start, end = problem
    assert bits_equal(rs.kernel(x, indices, start, end), oracle(x, indices, start, end, by_index=True))


PROPERTIES = [ragged_scatter_kernel_matches_oracle]


@pytest.mark.parametrize("impl", [rs.kernel, rs.reference], ids=["kernel", "reference"])
def test_no_rows_and_nothing_selected_gives_zeros(impl):
    # x of no rows, every index outside [start, end): zero rows; the reference once raised
    # ATen's index_select error.
    x = torch.randn(0, 3, requires_grad=True)
    out = impl(x, torch.tensor([0, 3]), torch.tensor(0), torch.tensor(0))
    out.sum().backward()
    assert torch.equal(out, torch.zeros(2, 3)) and x.grad.shape == (0, 3)
