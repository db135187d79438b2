"""layer_norm / rms_norm: contract samples, float64-oracle numerics (forward and every
gradient), the fused residual, batch invariance, fixed-order dscale sums and the property test."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample, threads
from strategies import DTYPES, PROFILE, layout
from tokamax_torch.ops import layer_norm as ln

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float64: 1e-12}
# Gradients in low precision: dx is rounded to the dtype once, dscale/doffset sum many rows.
GRAD_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 8e-3}


def oracle(x, scale=None, offset=None, *, epsilon=1e-6, scale_offset=0.0, subtract_mean=True, residual=None):
    """float64 of the same math; h is rounded to x's dtype as the ops store it."""
    h = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    w = h.double()
    mean = w.mean(-1, keepdim=True) if subtract_mean else torch.zeros_like(w[..., :1])
    rstd = torch.rsqrt((w - mean).pow(2).mean(-1, keepdim=True) + epsilon)
    y = (w - mean) * rstd
    if scale is not None:
        y = y * (scale.double() + scale_offset)
    if offset is not None:
        y = y + offset.double()
    return y, h, mean.squeeze(-1), rstd.squeeze(-1)


def _close(got, want, tol, what=""):
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("impl,num_threads", [(ln.reference, None)] + [(ln.kernel, n) for n in THREAD_COUNTS],
                         indirect=["num_threads"])
def test_forward_matches_float64_oracle(impl, num_threads, dtype, subtract_mean):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 37, 130, generator=g) * 3 + 1).to(dtype)[:, ::2, 1:]  # strided rows, odd length
    res = torch.randn(3, 19, 129, generator=g).to(dtype)
    scale = torch.randn(129, generator=g)
    offset = torch.randn(129, generator=g).to(dtype)  # x's dtype: allowed as well as fp32
    for residual in (None, res):
        (out, (mean, rstd)) = impl(x, scale, offset, scale_offset=1.0, subtract_mean=subtract_mean,
                                   residual=residual, epsilon=1e-5, return_residuals=True)
        y, h, want_mean, want_rstd = oracle(x, scale, offset, epsilon=1e-5, scale_offset=1.0,
                                            subtract_mean=subtract_mean, residual=residual)
        if residual is not None:
            out, got_h = out
            _close(got_h, h, 0, "h")
        assert out.dtype == dtype and out.shape == x.shape and mean.shape == rstd.shape == x.shape[:-1]
        _close(out, y, TOLERANCE[dtype], "y")
        _close(rstd, want_rstd, 1e-5 if dtype != torch.float64 else 1e-12, "rstd")
        _close(mean, want_mean, 1e-5 if dtype != torch.float64 else 1e-12, "mean")


@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("dtype", GRAD_TOLERANCE)
@pytest.mark.parametrize("impl,num_threads", [(ln.reference, None), (ln.kernel, 1), (ln.kernel, 3)],
                         indirect=["num_threads"])
def test_gradients_match_float64_oracle(impl, num_threads, dtype, subtract_mean):
    """dx, dresidual, dscale, doffset, with cotangents on both y and h."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, 45, generator=g).to(dtype)
    res = torch.randn(70, 45, generator=g).to(dtype)
    scale = torch.randn(45, generator=g)
    offset = torch.randn(45, generator=g)
    dy = torch.randn(70, 45, generator=g).to(dtype)
    dh = torch.randn(70, 45, generator=g).to(dtype)

    def grads(fn, *tensors):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        y, h = fn(*leaves)
        torch.autograd.backward([y, h], [dy.to(y.dtype), dh.to(h.dtype)])
        return [t.grad for t in leaves]

    got = grads(lambda a, b, s, o: impl(a, s, o, residual=b, scale_offset=0.5, subtract_mean=subtract_mean),
                x, res, scale, offset)
    # The oracle's h is x + residual in float64 (the rounding of h has no gradient).
    want = grads(lambda a, b, s, o: (lambda y, h: (y, a + b))(
        *oracle(a + b, s, o, scale_offset=0.5, subtract_mean=subtract_mean)[:2]),
        x.double(), res.double(), scale.double(), offset.double())
    tol = GRAD_TOLERANCE[dtype]
    for name, a, b in zip(("dx", "dresidual", "dscale", "doffset"), got, want):
        scale_of = b.abs().max().item()
        _close(a / scale_of, b / scale_of, tol, name)
    assert got[2].dtype == torch.float32 and got[0].dtype == dtype


@pytest.mark.parametrize("num_threads", [1], indirect=True)
@pytest.mark.parametrize("subtract_mean", [True, False])
def test_gradcheck_float64(num_threads, subtract_mean):
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    scale, offset = (torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def fn(x, res, scale, offset):
        return ln.kernel(x, scale, offset, residual=res, epsilon=1e-3, scale_offset=1.0, subtract_mean=subtract_mean)

    assert torch.autograd.gradcheck(fn, (x, res, scale, offset))
    assert torch.autograd.gradcheck(lambda a, s: ln.kernel(a, s, subtract_mean=subtract_mean), (x, scale))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_batch_invariant(dtype):
    """A row's output bits do not depend on how many rows share the call or on the config."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 1000, generator=g).to(dtype)
    scale = torch.randn(1000, generator=g)
    full = ln.kernel(x, scale, configs=(ln.Config(block_rows=7), None))
    for rows in (slice(0, 1), slice(5, 6), slice(13, 200)):
        for block_rows in (1, 64):
            part = ln.kernel(x[rows], scale, configs=(ln.Config(block_rows=block_rows), None))
            assert torch.equal(part, full[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_past_the_caches_equal_the_cached_path(dtype):
    """From 32 MiB on, y (forward) and dx, dresidual (backward) are written with non-temporal
    stores: every row's bits equal those of a small call (cached stores), rows misaligned for
    the streaming stores included (an odd column count), and a fused residual's outputs too."""
    g = torch.Generator().manual_seed(11)
    for cols in (4096, 4099):
        rows = (32 << 20) // (cols * dtype.itemsize) + 3  # just past the threshold
        x = torch.randn(rows, cols, generator=g).to(dtype).requires_grad_(True)
        res = torch.randn(rows, cols, generator=g).to(dtype).requires_grad_(True)
        scale = torch.randn(cols, generator=g)
        dy, dh = (torch.randn(rows, cols, generator=g).to(dtype) for _ in range(2))
        y, h = ln.kernel(x, scale, residual=res)
        dx, dres = torch.autograd.grad((y, h), (x, res), (dy, dh))
        picked = [0, 1, rows // 2, rows - 1]
        xs, rs = x.detach()[picked].requires_grad_(True), res.detach()[picked].requires_grad_(True)
        ys, hs = ln.kernel(xs, scale, residual=rs)
        dxs, drs = torch.autograd.grad((ys, hs), (xs, rs), (dy[picked], dh[picked]))
        for big, small in ((y, ys), (h, hs), (dx, dxs), (dres, drs)):
            assert torch.equal(big[picked], small), (cols, dtype)
        # And against the float64 oracle, on the picked rows.
        want = oracle(x.detach()[picked], scale, residual=res.detach()[picked])[0]
        _close(y[picked], want, TOLERANCE[dtype], f"y, {cols} columns")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dscale_is_bitwise_equal_across_thread_counts(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4000, 96, generator=g).to(dtype)
    dy = torch.randn(4000, 96, generator=g).to(dtype)
    results = []
    for n in THREAD_COUNTS:
        with threads(n):
            scale = torch.randn(96, generator=torch.Generator().manual_seed(6)).requires_grad_(True)
            offset = torch.zeros(96, requires_grad=True)
            ln.kernel(x, scale, offset, configs=(None, ln.Config(block_rows=16))).backward(dy)
            results.append((scale.grad, offset.grad))
    for got in results[1:]:
        assert torch.equal(got[0], results[0][0]) and torch.equal(got[1], results[0][1])


def test_rms_norm_is_layer_norm_without_the_mean():
    x, scale = torch.randn(4, 33), torch.randn(33)
    assert torch.equal(ln.rms_norm(x, scale), ln.kernel(x, scale, subtract_mean=False))
    (_, (mean, _)) = ln.rms_norm(x, return_residuals=True)
    assert torch.equal(mean, torch.zeros(4))
    want = torch.nn.functional.rms_norm(x.double(), (33,), scale.double(), eps=1e-6)
    _close(ln.rms_norm_reference(x, scale), want, 2e-5, "rms_norm")


def test_matches_torch_layer_norm():
    x, w, b = torch.randn(6, 50), torch.randn(50), torch.randn(50)
    _close(ln.kernel(x, w, b, epsilon=1e-5), torch.nn.functional.layer_norm(x, (50,), w, b, eps=1e-5), 2e-5, "y")


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (1,), (5,), (2, 0, 4), (1, 2, 1, 2, 1, 2, 1, 2, 3), (4, 1)])
def test_special_shapes(shape):
    """Empty sizes, a 1-D x (one row), more dims than the kernel's rank (reshaped), one column."""
    x = torch.randn(shape, requires_grad=True)
    scale = torch.randn(shape[-1], requires_grad=True)
    y = ln.kernel(x, scale)
    assert y.shape == x.shape and not y.isnan().any()
    if shape[-1] > 0:
        _close(y, oracle(x.detach(), scale.detach())[0], 2e-5, "y")
    y.sum().backward()
    assert x.grad.shape == x.shape and scale.grad.shape == scale.shape and not x.grad.isnan().any()


def test_non_contiguous_last_axis_is_copied_not_misread():
    base = torch.randn(40, 6)
    x = base.t()  # last axis stride 6
    _close(ln.kernel(x), oracle(x)[0], 2e-5, "y")


def test_only_h_used_downstream():
    x, res = torch.randn(5, 16, requires_grad=True), torch.randn(5, 16, requires_grad=True)
    _, h = ln.kernel(x, residual=res)
    h.sum().backward()
    assert torch.equal(x.grad, torch.ones(5, 16)) and torch.equal(res.grad, torch.ones(5, 16))


def _sample(shape, dtype=torch.float32, scale=True, offset=True, **kwargs):
    def make():
        g = torch.Generator().manual_seed(7)
        x = torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)
        args = [x]
        if scale:
            args.append(torch.randn(shape[-1], generator=g).requires_grad_(True))
        if offset:
            args.append(torch.randn(shape[-1], generator=g).requires_grad_(True))
        if "residual" in kwargs:
            kwargs["residual"] = torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)
        return tuple(args), dict(kwargs)
    return make


CONTRACT = OpContract(
    name="layer_norm",
    reference=ln.reference,
    kernel=ln.kernel,
    samples=[
        Sample("fp32", _sample((6, 40))),
        Sample("rms-gemma", _sample((2, 3, 40), subtract_mean=False, scale_offset=1.0, epsilon=1e-5)),
        Sample("residual", _sample((6, 40), residual=True)),
        Sample("bf16", _sample((6, 40), torch.bfloat16), compile=False),
        Sample("no-scale", _sample((5, 33), scale=False, offset=False)),
        Sample("transposed", lambda: ((torch.randn(40, 6).t().requires_grad_(True),), {"epsilon": 1e-3})),
    ],
    bad_inputs=lambda: [
        BadInput(r"axis must be in \[-2, 2\) for a 2-D x, got 2", (torch.randn(2, 3),), {"axis": 2}),
        BadInput("axis must be the last axis", (torch.randn(2, 3),), {"axis": 0}),
        BadInput(r"scale must have length 3 \(x's last axis\), got shape \[4\]", (torch.randn(2, 3), torch.randn(4))),
        BadInput(r"offset must have length 3 \(x's last axis\), got shape \[2\]",
                 (torch.randn(2, 3), None, torch.randn(2))),
        BadInput("scale must be 1-D", (torch.randn(2, 3), torch.randn(1, 3))),
        BadInput("scale must be float32 or x's dtype", (torch.randn(2, 3), torch.randn(3, dtype=torch.float64))),
        BadInput("epsilon must be positive, got 0", (torch.randn(2, 3),), {"epsilon": 0.0}),
        BadInput("epsilon must be positive, got -1", (torch.randn(2, 3),), {"epsilon": -1.0}),
        BadInput(r"residual must have x's shape \[2, 3\], got \[2, 4\]", (torch.randn(2, 3),),
                 {"residual": torch.randn(2, 4)}),
        BadInput("residual must have x's dtype", (torch.randn(2, 3),),
                 {"residual": torch.randn(2, 3, dtype=torch.bfloat16)}),
        BadInput("x must be float32, bfloat16, float16 or float64, got Int", (torch.ones(2, 3, dtype=torch.int32),)),
    ],
    invalid_configs=[
        ("expected 1 value", ([8, 1], None)),
        ("config: layer_norm config: block_rows must be in", ([0], None)),
        ("bwd_config: layer_norm config: block_rows", (None, [10**6])),
    ],
    config_samples={"forward": Sample("rows", _sample((300, 64))), "backward": Sample("rows", _sample((300, 64)))},
    dynamic=[DynamicSizes("rows", lambda r: ((torch.randn(r, 24, requires_grad=True),
                                              torch.randn(24, requires_grad=True)), {}),
                          [{"r": 5}, {"r": 9}, {"r": 17}], {"r": (2, 4096)},
                          lambda dims: ({0: dims["r"]}, None))],
    determinism_samples=[Sample("many-rows", _sample((2000, 300))),
                         Sample("residual", _sample((1500, 200), torch.bfloat16, residual=True))],
)


@st.composite
def layer_norm_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    shape = (draw(st.integers(0, 40), label="rows"), draw(st.integers(1, 300), label="cols"))
    x = layout(draw, shape, generator, dtype, "x")
    residual = layout(draw, shape, generator, dtype, "residual") if draw(st.booleans(), label="residual") else None
    scale = torch.randn(shape[-1], generator=generator).to(draw(st.sampled_from([torch.float32, dtype])))
    offset = torch.randn(shape[-1], generator=generator) if draw(st.booleans(), label="offset") else None
    options = dict(subtract_mean=draw(st.booleans(), label="subtract_mean"),
                   scale_offset=draw(st.sampled_from([None, 1.0])), epsilon=draw(st.sampled_from([None, 1e-3])))
    return x, scale, offset, residual, options


@settings(PROFILE, max_examples=150)
@given(problem=layer_norm_problems())
def layer_norm_kernel_matches_float64_oracle(problem):
    x, scale, offset, residual, options = problem
    out = ln.kernel(x, scale, offset, residual=residual, **options)
    y = out[0] if residual is not None else out
    assert not y.isnan().any()
    want = oracle(x, scale, offset, residual=residual, epsilon=options["epsilon"] or 1e-6,
                  scale_offset=options["scale_offset"] or 0.0, subtract_mean=options["subtract_mean"])
    _close(y, want[0], TOLERANCE[x.dtype], "y")
    if residual is not None:
        assert torch.equal(out[1], want[1])


PROPERTIES = [layer_norm_kernel_matches_float64_oracle]


def test_statistics_are_not_differentiable():
    """mean and rstd come back without a gradient history; h with a residual carries one."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g, requires_grad=True)
    res = torch.randn(4, 16, generator=g, requires_grad=True)
    (y, (mean, rstd)) = ln.kernel(x, return_residuals=True)
    assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad
    ((y, h), (mean, rstd)) = ln.kernel(x, residual=res, return_residuals=True)
    assert y.requires_grad and h.requires_grad and not mean.requires_grad and not rstd.requires_grad
    (dx, dres) = torch.autograd.grad(h.sum(), [x, res])
    assert torch.equal(dx, torch.ones_like(x)) and torch.equal(dres, torch.ones_like(res))


def test_compiled_autograd_through_h_with_a_residual():
    """h = x + residual is the one differentiable output beside y: its gradient under compiled
    autograd equals eager's (the contract's check weights y only)."""
    g = torch.Generator().manual_seed(5)
    x, res, scale = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g), torch.randn(32, generator=g)
    dy, dh = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in (x, res, scale)]
        y, h = ln.kernel(leaves[0], leaves[2], residual=leaves[1])
        return torch.autograd.grad((y * dy).sum() + (h * dh).sum(), leaves)

    want = grads()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        got = grads()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
