"""gated_linear_unit: contract samples, float64-oracle numerics (forward, residuals, dx and
dweights for every activation, dtype and weight form), clear errors and the property test."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import DTYPES, PROFILE, layout
from tokamax_torch.ops import gated_linear_unit as glu

TOLERANCE = {torch.float32: 5e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# Gradients in low precision: the backward's GEMMs take the pre-activation gradients in x's dtype.
GRAD_TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}
ACTIVATIONS = ["swish", "gelu", "gelu_exact", "relu", "sigmoid", None]

_ACT = {"swish": F.silu, "silu": F.silu, "gelu": lambda t: F.gelu(t, approximate="tanh"), "gelu_exact": F.gelu,
        "relu": F.relu, "sigmoid": torch.sigmoid, None: lambda t: t}


def oracle(x, weights, activation="swish"):
    """float64 of the same math: (out, pre-activations [..., 2, N])."""
    gate, up = weights if isinstance(weights, tuple) else (weights[:, 0], weights[:, 1])
    g = x.double() @ gate.double()
    u = x.double() @ up.double()
    return _ACT[activation](g) * u, torch.stack([g, u], -2)


def _close(got, want, tol, what=""):
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _problem(shape=(2, 9, 40), n=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(k, 2, n, generator=g) / k ** 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("impl,num_threads", [(glu.reference, None)] + [(glu.kernel, n) for n in THREAD_COUNTS],
                         indirect=["num_threads"])
def test_forward_matches_float64_oracle(impl, num_threads, dtype, activation):
    x, w = _problem(dtype=dtype)
    out, residuals = impl(x, w, activation=activation, return_residuals=True)
    want, pre = oracle(x, w, activation)
    assert out.dtype == dtype and out.shape == (2, 9, 37) and residuals.shape == (2, 9, 2, 37)
    _close(out, want, TOLERANCE[dtype], "out")
    _close(residuals, pre, TOLERANCE[dtype], "residuals")
    _close(impl(x, w, activation=activation), out, 0.0, "without residuals")


@pytest.mark.parametrize("form", ["fused", "pair", "linear-views", "fused-transposed"])
@pytest.mark.parametrize("dtype", TOLERANCE)
def test_weight_forms_forward_and_gradients(form, dtype):
    """Fused [K, 2, N], a pair, nn.Linear weights' transposed views and a fused transposed view
    ([2N, K] storage): read in place, gradients in each input's shape."""
    x, w = _problem(dtype=dtype, seed=1)
    k, n = w.shape[0], w.shape[2]
    if form == "fused":
        weights = w.clone()
    elif form == "pair":
        weights = (w[:, 0].contiguous(), w[:, 1].contiguous())
    elif form == "linear-views":
        weights = (w[:, 0].t().contiguous().t(), w[:, 1].t().contiguous().t())
    else:
        weights = w.reshape(k, 2 * n).t().contiguous().t().view(k, 2, n)
    leaves = list(weights) if isinstance(weights, tuple) else [weights]
    leaves = [t.requires_grad_(True) for t in leaves]
    weights = tuple(leaves) if isinstance(weights, tuple) else leaves[0]
    xg = x.clone().requires_grad_(True)
    out = glu.kernel(xg, weights, activation="swish")
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    out.backward(dy)
    xd = x.double().requires_grad_(True)
    wd = [t.detach().double().requires_grad_(True) for t in leaves]
    want, _ = oracle(xd, tuple(wd) if len(wd) == 2 else wd[0])
    want.backward(dy.double())
    _close(out, want, TOLERANCE[dtype], "out")
    _close(xg.grad, xd.grad, GRAD_TOLERANCE[dtype], "dx")
    for got, ref in zip(leaves, wd):
        assert got.grad.shape == got.shape
        _close(got.grad, ref.grad, GRAD_TOLERANCE[dtype] * 4, "dweights")  # sums over all 18 rows


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", GRAD_TOLERANCE)
@pytest.mark.parametrize("num_threads", [1, 3], indirect=True)
def test_gradients_match_float64_oracle(num_threads, dtype, activation):
    x, w = _problem((3, 20, 48), 40, dtype, seed=2)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = glu.kernel(xg, wg, activation=activation)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    out.backward(dy)
    xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
    oracle(xd, wd, activation)[0].backward(dy.double())
    _close(xg.grad, xd.grad, GRAD_TOLERANCE[dtype], "dx")
    _close(wg.grad, wd.grad, GRAD_TOLERANCE[dtype] * 4, "dweights")


@pytest.mark.parametrize("num_threads", [1], indirect=True)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(num_threads, activation):
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 2, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: glu.kernel(a, b, activation=activation), (x, w))


def test_frozen_weights_and_frozen_x():
    """Only the gradients asked for are computed, and each matches the full backward's."""
    x, w = _problem(seed=4)
    full_x, full_w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    glu.kernel(full_x, full_w).sum().backward()
    only_x = x.clone().requires_grad_(True)
    glu.kernel(only_x, w).sum().backward()
    only_w = w.clone().requires_grad_(True)
    glu.kernel(x, only_w).sum().backward()
    assert torch.equal(only_x.grad, full_x.grad) and torch.equal(only_w.grad, full_w.grad)


class _OpLog(TorchDispatchMode):
    """The gated_linear_unit ops a region dispatches."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "gated_linear_unit" in str(func):
            self.ops.append(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


def test_backward_overwrites_residuals_only_when_the_graph_is_freed():
    """A plain backward writes d(pre-activations) over the saved residuals (no [M, 2N] of its
    own); retain_graph and returned residuals keep them intact; the gradients are bitwise the
    same either way, and a second backward through a freed graph still raises."""
    x, w = _problem((2, 9, 40), 37, seed=6)
    dy = torch.randn(2, 9, 37, generator=torch.Generator().manual_seed(7))
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

    def grads_of(out, **kwargs):
        xg.grad = wg.grad = None
        with _OpLog() as log:
            out.backward(dy, **kwargs)
        return (xg.grad, wg.grad), log.ops

    plain, ops = grads_of(glu.kernel(xg, wg))
    assert ops == ["_gated_linear_unit_backward_overwrite"]
    out = glu.kernel(xg, wg)
    retained, ops = grads_of(out, retain_graph=True)
    assert ops == ["_gated_linear_unit_backward"]
    again, ops = grads_of(out)  # the graph was kept: the residuals are intact for this one
    assert ops == ["_gated_linear_unit_backward_overwrite"]
    for got in (retained, again):
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    with pytest.raises(RuntimeError, match="second time"):
        out.backward(dy)
    out, residuals = glu.kernel(xg, wg, return_residuals=True)
    kept = residuals.clone()
    returned, ops = grads_of(out)
    assert ops == ["_gated_linear_unit_backward"] and torch.equal(residuals, kept)
    assert torch.equal(returned[0], plain[0]) and torch.equal(returned[1], plain[1])


def test_overwrite_op_matches_the_functional_backward():
    """The `_overwrite` op gives the functional op's bits and leaves dpre in the residuals."""
    x, w = _problem((12, 40), 37, seed=8)
    out, residuals = glu.kernel(x, w, return_residuals=True)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    want = torch.ops.tokamax._gated_linear_unit_backward(dy, x, w, None, residuals, "swish", True, True, None)
    scratch = residuals.clone()
    got = torch.ops.tokamax._gated_linear_unit_backward_overwrite(dy, x, w, None, scratch, "swish", True, True, None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    g, u = residuals[:, 0], residuals[:, 1]
    _close(scratch[:, 1], dy * F.silu(g), 1e-6, "dup written over up")
    _close(scratch[:, 0], dy * u * torch.func.grad(lambda t: F.silu(t).sum())(g), 1e-5, "dgate written over gate")


def test_decode_blocking_follows_the_weights_layout():
    """A few-row forward reads contiguous weights in place and is blocked for that; nn.Linear's
    transposed views are packed and keep the packed blocking. The cache key tells them apart, and
    the autotuning runner rebuilds views with strided columns. Both agree with the oracle."""
    x = torch.randn(4, 512)
    w = torch.randn(512, 2, 256) / 512 ** 0.5
    views = (w[:, 0].t().contiguous().t(), w[:, 1].t().contiguous().t())
    fused_config, views_config = glu.kernel.get_configs(x, w)[0], glu.kernel.get_configs(x, views)[0]
    assert fused_config.block_k != views_config.block_k
    assert glu.kernel.cache_key(x, w)["weights_in_place"] is True
    assert glu.kernel.cache_key(x, views)["weights_in_place"] is False
    bound = glu.kernel.bind(x, views)
    assert bound.op.real_argument(bound, "weights", views, torch.Generator()).stride(-1) != 1
    want = F.silu(x.double() @ w[:, 0].double()) * (x.double() @ w[:, 1].double())
    for weights in (w, views):
        torch.testing.assert_close(glu.kernel(x, weights).double(), want, rtol=1e-5, atol=1e-5)


def test_inference_saves_nothing():
    """Without grad the kernel writes no pre-activations: its residual output is empty."""
    x, w = _problem()
    out, residuals = glu.kernel.op(x, w, None, "swish", False, None, None)
    assert residuals.numel() == 0 and out.shape == (2, 9, 37)


def _sample(shape=(6, 40), n=24, dtype=torch.float32, pair=False, **kwargs):
    def make():
        x, w = _problem(shape, n, dtype)
        weights = (w[:, 0].contiguous(), w[:, 1].contiguous()) if pair else w.requires_grad_(True)
        return (x.requires_grad_(True), weights), kwargs
    return make


CONTRACT = OpContract(
    name="gated_linear_unit",
    reference=glu.reference,
    kernel=glu.kernel,
    samples=[
        Sample("fp32-swish", _sample()),
        Sample("batched-gelu", _sample((2, 3, 40), activation="gelu")),
        Sample("pair-relu", _sample(pair=True, activation="relu")),
        Sample("bilinear", _sample(activation=None)),
        Sample("bf16", _sample(dtype=torch.bfloat16), compile=False),
        Sample("transposed-x", lambda: ((torch.randn(40, 6).t().requires_grad_(True),
                                         (torch.randn(40, 2, 24) / 7).requires_grad_(True)),
                                        {"activation": "gelu_exact"})),
    ],
    bad_inputs=lambda: [
        BadInput(r"weights must have K = x.shape\[-1\] = 3 rows, got shape \[4, 2, 5\]",
                 (torch.randn(2, 3), torch.randn(4, 2, 5))),
        BadInput(r"activation must be one of swish \(silu\), gelu, gelu_exact, relu, sigmoid or None, got 'tanh'",
                 (torch.randn(2, 3), torch.randn(3, 2, 5)), {"activation": "tanh"}),
        BadInput(r"weights must be fused \[K, 2, N\] or a pair of \[K, N\], got shape \[3, 5\]",
                 (torch.randn(2, 3), torch.randn(3, 5))),
        BadInput(r"weights must be fused \[K, 2, N\] or a pair of \[K, N\], got shape \[3, 3, 5\]",
                 (torch.randn(2, 3), torch.randn(3, 3, 5))),
        BadInput(r"weights must be fused \[K, 2, N\] or a pair of \[K, N\], got a pair of shapes \[3, 2, 5\]",
                 (torch.randn(2, 3), (torch.randn(3, 2, 5), torch.randn(3, 5)))),
        BadInput(r"the pair of weights must have one shape \[K, N\], got \[3, 5\] and \[3, 4\]",
                 (torch.randn(2, 3), (torch.randn(3, 5), torch.randn(3, 4)))),
        BadInput(r"x must be \[..., M, K\] \(at least 2-D\), got shape \[3\]", (torch.randn(3), torch.randn(3, 2, 5))),
        BadInput("weights must have x's dtype Float, got BFloat16",
                 (torch.randn(2, 3), torch.randn(3, 2, 5, dtype=torch.bfloat16))),
        BadInput("x must be float32, bfloat16, float16 or float64, got Int",
                 (torch.ones(2, 3, dtype=torch.int32), torch.randn(3, 2, 5))),
    ],
    invalid_configs=[
        ("expected 4 values", ([8], None)),
        ("config: gated_linear_unit config: block_m must be", ([5, 256, 256, 768], None)),
        ("bwd_config: gated_linear_unit config: task_m", (None, [96, 256, 256, 100])),
    ],
    config_samples={"forward": Sample("rows", _sample((300, 64), 80)),
                    "backward": Sample("rows", _sample((300, 64), 80))},
    dynamic=[DynamicSizes("rows", lambda r: ((torch.randn(r, 24, requires_grad=True),
                                              torch.randn(24, 2, 16, requires_grad=True)), {}),
                          [{"r": 5}, {"r": 9}, {"r": 17}], {"r": (2, 4096)},
                          lambda dims: ({0: dims["r"]}, None))],
    determinism_samples=[Sample("many-rows", _sample((700, 96), 200)),
                         Sample("bf16", _sample((600, 64), 160, torch.bfloat16, activation="gelu"))],
)


@st.composite
def gated_linear_unit_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    m, k, n = (draw(st.integers(0, 40), label="m"), draw(st.integers(0, 70), label="k"),
               draw(st.integers(0, 70), label="n"))
    x = layout(draw, (m, k), generator, dtype, "x")
    pair = draw(st.booleans(), label="pair")
    if pair:
        weights = (layout(draw, (k, n), generator, dtype, "gate"), layout(draw, (k, n), generator, dtype, "up"))
    else:
        weights = layout(draw, (k, 2, n), generator, dtype, "weights")
    return x, weights, draw(st.sampled_from(ACTIVATIONS))


@settings(PROFILE, max_examples=150)
@given(problem=gated_linear_unit_problems())
def gated_linear_unit_kernel_matches_float64_oracle(problem):
    x, weights, activation = problem
    out = glu.kernel(x, weights, activation=activation)
    want, _ = oracle(x, weights, activation)
    assert out.shape == want.shape and not out.isnan().any()
    tol = TOLERANCE[x.dtype] * max(1.0, x.shape[-1] ** 0.5)  # unscaled random weights: sums grow with K
    _close(out, want, tol)


PROPERTIES = [gated_linear_unit_kernel_matches_float64_oracle]


def test_residuals_are_not_differentiable():
    x, w = _problem((6, 40), 24, seed=4)
    out, residuals = glu.kernel(x.requires_grad_(True), w, return_residuals=True)
    assert out.requires_grad and not residuals.requires_grad and residuals.grad_fn is None
