"""ragged_gather_reduce: a float64 oracle for the forward and both gradients, masking (NaN in
masked rows stays out), its errors, its CONTRACT and its property test."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import DTYPES, PROFILE, layout
from tokamax_torch.ops import ragged_gather_reduce as rgr

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}


def oracle(x, indices, weights, valid, g):
    """float64, one (token, slot) at a time."""
    out = torch.zeros(indices.shape[0] // g, x.shape[1], dtype=torch.float64)
    for j in range(indices.shape[0]):
        if valid[j]:
            out[j // g] += weights[j].double() * x[int(indices[j])].double()
    return out


def oracle_grads(dout, x, indices, weights, valid, g):
    dx = torch.zeros(x.shape, dtype=torch.float64)
    dw = torch.zeros(indices.shape[0], dtype=torch.float64)
    for j in range(indices.shape[0]):
        if valid[j]:
            dx[int(indices[j])] += weights[j].double() * dout[j // g].double()
            dw[j] = (dout[j // g].double() * x[int(indices[j])].double()).sum()
    return dx, dw


def problem(rows=11, hidden=24, tokens=7, g=3, dtype=torch.float32, weight_dtype=torch.float32,
            index_dtype=torch.int32, masked=0.25, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    n = tokens * g
    indices = torch.randint(0, max(rows, 1), (n,), generator=gen).to(index_dtype)
    weights = torch.rand(n, generator=gen).to(weight_dtype)
    valid = torch.rand(n, generator=gen) >= masked
    return x, indices, weights, valid, g


IMPLS = [(rgr.reference, None)] + [(rgr.kernel, n) for n in THREAD_COUNTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("impl,num_threads", IMPLS, indirect=["num_threads"])
def test_forward_and_gradients_match_float64_oracle(impl, num_threads, dtype):
    x, indices, weights, valid, g = problem(rows=13, hidden=600, tokens=9, g=4, dtype=dtype, seed=1)
    x = torch.randn(600, 26).to(dtype).t()[::2].requires_grad_(True)  # strided [13, 600]
    weights.requires_grad_(True)
    out = impl(x, indices, weights, valid, g)
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == (9, 600)
    torch.testing.assert_close(out.double(), oracle(x.detach(), indices, weights.detach(), valid, g), rtol=tol, atol=tol)
    dout = torch.randn(600, 9).to(dtype).t()  # strided
    dx, dw = torch.autograd.grad(out, (x, weights), dout)
    want_dx, want_dw = oracle_grads(dout, x.detach(), indices, weights.detach(), valid, g)
    torch.testing.assert_close(dx.double(), want_dx, rtol=tol, atol=tol)
    # dw is stored in topk_weights' dtype (fp32 here) and sums 600 products of x's dtype.
    assert dw.dtype == weights.dtype
    dw_tol = max(tol, TOLERANCE[weights.dtype])
    torch.testing.assert_close(dw.double(), want_dw, rtol=dw_tol, atol=dw_tol * 30)


@pytest.mark.parametrize("num_threads", [1], indirect=True)
def test_gradcheck_float64(num_threads):
    x, indices, weights, valid, g = problem(rows=5, hidden=3, tokens=4, g=2, dtype=torch.float64,
                                            weight_dtype=torch.float64)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, w: rgr.kernel(a, indices, w, valid, g), (x, weights))


@pytest.mark.parametrize("impl", [rgr.reference, rgr.kernel], ids=["reference", "kernel"])
def test_masked_rows_add_nothing_even_nan_and_any_index(impl):
    x, indices, weights, valid, g = problem(rows=4, hidden=5, tokens=3, g=2, masked=0.0)
    x[3] = float("nan")
    valid[:] = True
    valid[[1, 4]] = False
    indices = torch.tensor([0, 3, 1, 2, 1000, 1], dtype=torch.int32)  # 3: a NaN row, 1000: never read
    weights[4] = float("nan")  # a NaN weight, masked
    want = oracle(x, indices, weights, valid, g)
    out = impl(x, indices, weights, valid, g)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", [rgr.reference, rgr.kernel], ids=["reference", "kernel"])
def test_rows_nobody_gathers_get_zero_gradient(impl):
    x, indices, weights, valid, g = problem(rows=6, hidden=4, tokens=2, g=2)
    indices = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    valid = torch.tensor([True, True, True, False])
    x.requires_grad_(True)
    impl(x, indices, weights, valid, g).sum().backward()
    assert (x.grad[[1, 3, 4, 5]] == 0).all() and (x.grad[[0, 2]] != 0).all()


def test_kernel_sums_each_group_in_slot_order():
    # fp32 rounding makes the order visible: 1 + 1e-8 + ... in order is 1, reversed is not.
    x = torch.tensor([[1.0], [1e-8]])
    indices = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    out = rgr.kernel(x, indices, torch.ones(10), torch.ones(10, dtype=torch.bool), 10)
    assert out.item() == torch.tensor(1.0).item()


# ---- the contract ----------------------------------------------------------------------------

def _sample(**kwargs):
    def make():
        x, indices, weights, valid, g = problem(**kwargs)
        return (x.requires_grad_(True), indices, weights.requires_grad_(True), valid, g), {}
    return make


def _bad_inputs():
    x, indices, weights, valid, g = problem(rows=5, hidden=4, tokens=3, g=2)
    return [
        BadInput(r"ragged_gather_reduce: x must be 2-D \[R, H\], got shape \[20\]", (x.view(-1), indices, weights, valid, g)),
        BadInput("ragged_gather_reduce: x must be float32, bfloat16, float16 or float64, got Int",
                 (x.int(), indices, weights, valid, g)),
        BadInput(r"ragged_gather_reduce: indices must be 1-D \[N\], got shape \[3, 2\]",
                 (x, indices.view(3, 2), weights, valid, g)),
        BadInput("ragged_gather_reduce: indices must be int32 or int64, got Float", (x, indices.float(), weights, valid, g)),
        BadInput(r"ragged_gather_reduce: topk_weights must be a 1-D \[N\] float tensor, got Int",
                 (x, indices, weights.int(), valid, g)),
        BadInput(r"ragged_gather_reduce: valid_rows_mask must be a 1-D \[N\] bool tensor, got Float",
                 (x, indices, weights, valid.float(), g)),
        BadInput(r"ragged_gather_reduce: topk_weights must have one weight per index, \[N\] = \[6\], got shape \[5\]",
                 (x, indices, weights[:5], valid, g)),
        BadInput(r"ragged_gather_reduce: valid_rows_mask must have one flag per index, \[N\] = \[6\]",
                 (x, indices, weights, valid[:4], g)),
        BadInput("ragged_gather_reduce: reduce_group_size must be >= 1, got 0", (x, indices, weights, valid, 0)),
        BadInput("ragged_gather_reduce: reduce_group_size must divide N=6, got 4", (x, indices, weights, valid, 4)),
        BadInput(r"ragged_gather_reduce: indices\[3\] must be in \[0, R=5\) \(a row of x\) where valid_rows_mask is "
                 r"set, got 5", (x, torch.tensor([0, 1, 2, 5, 1, 0]), weights, torch.ones(6, dtype=torch.bool), g),
                 kernel_only=True),
        BadInput(r"ragged_gather_reduce: indices\[0\] must be in \[0, R=5\)",
                 (x, torch.tensor([-1, 1, 2, 4, 1, 0], dtype=torch.int32), weights, torch.ones(6, dtype=torch.bool), g),
                 kernel_only=True),
    ]


CONTRACT = OpContract(
    name="ragged_gather_reduce",
    reference=rgr.reference,
    kernel=rgr.kernel,
    samples=[
        Sample("fp32", _sample()),
        Sample("bf16-x-fp32-weights-int64", _sample(dtype=torch.bfloat16, index_dtype=torch.int64), compile=False),
        Sample("fp16-group-1", _sample(rows=6, hidden=10, tokens=12, g=1, dtype=torch.float16,
                                       weight_dtype=torch.float16)),
    ],
    bad_inputs=_bad_inputs,
    # T symbolic (N = 2T); its sizes differ from R=40, H=24 and g=2.
    dynamic=[DynamicSizes("tokens", lambda t: ((*problem(rows=40, hidden=24, tokens=t, g=2)[:4],), {"reduce_group_size": 2}),
                          [{"t": 5}, {"t": 9}, {"t": 17}], {"t": (2, 4096)},
                          lambda dims: (None, {0: 2 * dims["t"]}, {0: 2 * dims["t"]}, {0: 2 * dims["t"]}))],
    determinism_samples=[Sample("many-tokens", _sample(rows=3000, hidden=256, tokens=1500, g=4))],
)


# ---- property test -----------------------------------------------------------------------------

@st.composite
def ragged_gather_reduce_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    rows, hidden = draw(st.integers(1, 40), label="R"), draw(st.integers(0, 700), label="H")
    tokens, g = draw(st.integers(0, 30), label="T"), draw(st.integers(1, 8), label="g")
    x = layout(draw, (rows, hidden), generator, dtype, "x")
    indices = torch.randint(0, rows, (tokens * g,), generator=generator)
    indices = indices.to(draw(st.sampled_from([torch.int32, torch.int64])))
    weights = torch.rand(tokens * g, generator=generator).to(draw(st.sampled_from(DTYPES)))
    valid = torch.rand(tokens * g, generator=generator) >= draw(st.sampled_from([0.0, 0.5, 1.0]))
    return x, indices, weights, valid, g


@settings(PROFILE, max_examples=100)
@given(problem=ragged_gather_reduce_problems())
def ragged_gather_reduce_kernel_matches_float64_oracle(problem):
    x, indices, weights, valid, g = problem
    out = rgr.kernel(x, indices, weights, valid, g)
    tol = TOLERANCE[x.dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), oracle(x, indices, weights, valid, g), rtol=tol, atol=tol)


PROPERTIES = [ragged_gather_reduce_kernel_matches_float64_oracle]


@pytest.mark.parametrize("impl", [rgr.kernel, rgr.reference], ids=["kernel", "reference"])
def test_invalid_rows_reach_nothing_even_with_no_rows_or_nan(impl):
    # Invalid rows are never read, by the kernel or the reference: an x of no rows with nothing
    # valid gives zeros (the reference once raised ATen's index_select error), and NaN in an
    # invalid row's x or weight reaches neither the sum nor any gradient (the reference once let
    # 0 * NaN through).
    x = torch.randn(0, 3, requires_grad=True)
    out = impl(x, torch.tensor([5, 7]), torch.randn(2, requires_grad=True), torch.tensor([False, False]), 2)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(1, 3)) and x.grad.shape == (0, 3)
    x = torch.randn(4, 3)
    x[2] = float("nan")
    weights = torch.randn(4)
    weights[1] = float("nan")
    x.requires_grad_()
    weights.requires_grad_()
    valid = torch.tensor([True, False, True, True])  # entry 1 (row 2, weight 1) invalid
    out = impl(x, torch.tensor([0, 2, 1, 3]), weights, valid, 2)
    out.sum().backward()
    for t in (out, x.grad, weights.grad):
        assert not t.isnan().any()
    assert torch.equal(x.grad[2], torch.zeros(3)) and weights.grad[1] == 0
