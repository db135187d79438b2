"""ragged_gather: an exact oracle (a copy) for the forward, a float64 oracle for the backward, its
errors, its CONTRACT and its property test. The helpers serve tests/test_ragged_scatter.py too."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import DTYPES, PROFILE, layout
from tokamax_torch.ops import ragged_gather as rg

ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
GRAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}


def selected(indices, start, end, by_index):
    key = indices.long() if by_index else torch.arange(indices.shape[0])
    return (key >= int(start)) & (key < int(end))


def oracle(x, indices, start, end, by_index=False):
    """One row at a time; rows not selected are zeros."""
    out = torch.zeros(indices.shape[0], x.shape[1], dtype=x.dtype)
    for j, keep in enumerate(selected(indices, start, end, by_index).tolist()):
        if keep:
            out[j] = x[int(indices[j])]
    return out


def oracle_dx(dout, x, indices, start, end, by_index=False):
    dx = torch.zeros(x.shape, dtype=torch.float64)
    for j, keep in enumerate(selected(indices, start, end, by_index).tolist()):
        if keep:
            dx[int(indices[j])] += dout[j].double()
    return dx


def problem(rows=10, hidden=12, n=15, start=3, end=11, dtype=torch.float32, index_dtype=torch.int32,
            bound_dtype=torch.int32, by_index=False, seed=0):
    """Indices outside the kept rows are garbage (out of range), as the ops never read them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    indices = torch.randint(0, rows, (n,), generator=g)
    if not by_index:
        outside = torch.ones(n, dtype=torch.bool)
        outside[start:end] = False
        indices[outside] = 10**6
    return (x, indices.to(index_dtype), torch.tensor([start], dtype=bound_dtype),
            torch.tensor([end], dtype=bound_dtype))


def bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                                    b.contiguous().view(-1).view(torch.uint8))


def check_against_oracles(impl, by_index, dtype, args):
    x, indices, start, end = args
    x = x.detach().requires_grad_(True)
    out = impl(x, indices, start, end)
    assert bits_equal(out, oracle(x.detach(), indices, start, end, by_index))
    dout = torch.randn(out.shape[1], out.shape[0]).to(dtype).t()  # strided
    (dx,) = torch.autograd.grad(out, (x,), dout)
    tol = GRAD_TOLERANCE[dtype]
    torch.testing.assert_close(dx.double(), oracle_dx(dout, x.detach(), indices, start, end, by_index),
                               rtol=tol, atol=tol)


IMPLS = [(rg.reference, None)] + [(rg.kernel, n) for n in THREAD_COUNTS]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("impl,num_threads", IMPLS, indirect=["num_threads"])
def test_matches_oracles(impl, num_threads, dtype):
    x, indices, start, end = problem(rows=9, hidden=700, n=40, start=5, end=33, dtype=dtype, index_dtype=torch.int64)
    x = torch.randn(700, 18).to(dtype).t()[::2]  # strided [9, 700]
    check_against_oracles(impl, False, dtype, (x, indices, start, end))


@pytest.mark.parametrize("impl", [rg.reference, rg.kernel], ids=["reference", "kernel"])
def test_empty_range_and_zero_size_bounds(impl):
    x, indices, start, end = problem(start=4, end=4)
    assert not impl(x, indices, start, end).any()
    x, indices, start, end = problem(n=0, start=0, end=0)
    assert impl(x, indices, start.reshape(()), end.reshape(())).shape == (0, 12)


def test_kernel_copies_bits_exactly():
    x = torch.tensor([[-0.0, float("nan"), float("inf")], [1e-40, -1.0, 3.0]])
    out = rg.kernel(x, torch.tensor([1, 0]), torch.tensor([0]), torch.tensor([2]))
    assert bits_equal(out, x[[1, 0]])


# ---- the contract ----------------------------------------------------------------------------

def _sample(**kwargs):
    def make():
        x, indices, start, end = problem(**kwargs)
        return (x.requires_grad_(True), indices, start, end), {}
    return make


def bad_inputs(op, by_index):
    x, indices, start, end = problem(rows=5, hidden=4, n=6, start=1, end=4, by_index=by_index)
    limit = "R=5" if by_index else "N=6"
    bad = [
        BadInput(rf"{op}: x must be 2-D \[R, H\], got shape \[20\]", (x.view(-1), indices, start, end)),
        BadInput(f"{op}: x must be float32, bfloat16, float16 or float64, got Int", (x.int(), indices, start, end)),
        BadInput(rf"{op}: indices must be 1-D \[N\], got shape \[3, 2\]", (x, indices.view(3, 2), start, end)),
        BadInput(f"{op}: indices must be int32 or int64, got Float", (x, indices.float(), start, end)),
        BadInput(f"{op}: start must be an int32 or int64 tensor of one element, got Float", (x, indices, start.float(), end)),
        BadInput(rf"{op}: end must be an int32 or int64 tensor of one element, got shape \[2\]",
                 (x, indices, start, torch.tensor([4, 5]))),
        BadInput(rf"{op}: start and end must satisfy 0 <= start <= end <= {limit}, got start=3, end=2",
                 (x, indices, torch.tensor([3]), torch.tensor([2])), kernel_only=True),
        BadInput(rf"{op}: start and end must satisfy 0 <= start <= end <= {limit}, got start=0, end=7",
                 (x, indices, torch.tensor([0]), torch.tensor([7])), kernel_only=True),
    ]
    if not by_index:
        bad.append(BadInput(r"ragged_gather: indices\[2\] must be in \[0, R=5\) \(a row of x\) for start <= j < end, "
                            r"got 5", (x, torch.tensor([9, 0, 5, 1, 9, 9]), start, end), kernel_only=True))
    return bad


CONTRACT = OpContract(
    name="ragged_gather",
    reference=rg.reference,
    kernel=rg.kernel,
    samples=[
        Sample("fp32", _sample()),
        Sample("bf16-int64", _sample(dtype=torch.bfloat16, index_dtype=torch.int64, bound_dtype=torch.int64),
               compile=False),
    ],
    bad_inputs=lambda: bad_inputs("ragged_gather", False),
    # N symbolic; its sizes differ from R=40 and H=24.
    dynamic=[DynamicSizes("n", lambda n: (problem(rows=40, hidden=24, n=n, start=1, end=4), {}),
                          [{"n": 5}, {"n": 9}, {"n": 17}], {"n": (5, 4096)},
                          lambda dims: (None, {0: dims["n"]}, None, None))],
    determinism_samples=[Sample("many-rows", _sample(rows=3000, hidden=256, n=6000, start=100, end=5900))],
)


# ---- property test -----------------------------------------------------------------------------

@st.composite
def gather_problems(draw, by_index):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    rows, hidden, n = draw(st.integers(1, 40), label="R"), draw(st.integers(0, 700), label="H"), draw(
        st.integers(0, 60), label="N")
    limit = rows if by_index else n
    start = draw(st.integers(0, limit), label="start")
    end = draw(st.integers(start, limit), label="end")
    x = layout(draw, (rows, hidden), generator, dtype, "x")
    indices = torch.randint(0, rows, (n,), generator=generator)
    if not by_index:
        indices[:start] = -5  # never read
    indices = indices.to(draw(st.sampled_from([torch.int32, torch.int64])))
    return x, indices, torch.tensor([start]), torch.tensor([end])


@settings(PROFILE, max_examples=100)
@given(problem=gather_problems(by_index=False))
def ragged_gather_kernel_matches_oracle(problem):
    x, indices, start, end = problem
    assert bits_equal(rg.kernel(x, indices, start, end), oracle(x, indices, start, end))


PROPERTIES = [ragged_gather_kernel_matches_oracle]
