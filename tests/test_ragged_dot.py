"""ragged_dot: its contract samples, its float64-oracle numerics and its special cases.

The checks every op owes (opcheck, compile, export, configs, bad inputs, determinism) run in
tests/test_op_contract.py from CONTRACT below.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokamax_torch
from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import DTYPES, PROFILE, layout
from tokamax_torch.ops import ragged_dot as rd

IMPLEMENTATIONS = [rd.reference, rd.kernel]
# max|out - oracle| / max|oracle|, where the oracle is float64 math on the same (rounded) inputs;
# bf16/fp16 are dominated by the rounding of the output itself.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}


# The reference at the default thread count; the kernel, which promises the same bits at any
# count, at each of THREAD_COUNTS.
IMPLEMENTATIONS_AT_THREAD_COUNTS = [(rd.reference, None)] + [(rd.kernel, n) for n in THREAD_COUNTS]
IMPLEMENTATION_IDS = ["reference"] + [f"kernel-{n}threads" for n in THREAD_COUNTS]


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda impl: impl.name)
def impl(request):
    return request.param


def random_group_sizes(m, g, total=None, generator=None):
    total = m if total is None else total
    if g == 0:
        return torch.zeros(0, dtype=torch.int32)
    cuts = torch.sort(torch.randint(0, total + 1, (g - 1,), generator=generator)).values
    edges = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])
    return (edges[1:] - edges[:-1]).to(torch.int32)


def oracle(lhs, rhs, group_sizes, form=rd.DEFAULT):
    """float64 loops over groups: the ground truth."""
    lhs, rhs = lhs.double(), rhs.double()
    starts = [0]
    for s in group_sizes.tolist():
        starts.append(starts[-1] + s)
    if form == rd.RAGGED_CONTRACTING:
        out = torch.zeros(len(group_sizes), lhs.shape[1], rhs.shape[1], dtype=torch.float64)
        for g in range(len(group_sizes)):
            out[g] = lhs[starts[g] : starts[g + 1]].T @ rhs[starts[g] : starts[g + 1]]
        return out
    n = rhs.shape[1] if form == rd.TRANS_RHS else rhs.shape[2]
    out = torch.zeros(lhs.shape[0], n, dtype=torch.float64)
    for g in range(len(group_sizes)):
        w = rhs[g].T if form == rd.TRANS_RHS else rhs[g]
        out[starts[g] : starts[g + 1]] = lhs[starts[g] : starts[g + 1]] @ w
    return out


def make_operands(form, m, k, n, g, dtype, total=None):
    lhs = torch.randn(m, k).to(dtype)
    if form == rd.DEFAULT:
        rhs = torch.randn(g, k, n).to(dtype)
    elif form == rd.TRANS_RHS:
        rhs = torch.randn(g, n, k).to(dtype)
    else:
        rhs = torch.randn(m, n).to(dtype)
    return lhs, rhs, random_group_sizes(m, g, total)


def assert_matches_oracle(out, lhs, rhs, gs, form=rd.DEFAULT, tol=None):
    want = oracle(lhs, rhs, gs, form)
    assert out.shape == want.shape
    err = (out.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-6) if want.numel() else 0.0
    assert err <= (tol or TOLERANCE[out.dtype]), f"relative error {err}"


FORMS = {"default": rd.DEFAULT, "trans_rhs": rd.TRANS_RHS, "ragged_contracting": rd.RAGGED_CONTRACTING}


# ---- numerics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("m,k,n,g", [(64, 32, 48, 4), (37, 19, 23, 5), (130, 70, 100, 3), (5, 300, 17, 7)])
@pytest.mark.parametrize("impl,num_threads", IMPLEMENTATIONS_AT_THREAD_COUNTS, ids=IMPLEMENTATION_IDS,
                         indirect=["num_threads"])
def test_matches_float64_oracle(impl, num_threads, dtype, form, m, k, n, g):
    lhs, rhs, gs = make_operands(form, m, k, n, g, dtype, total=m - m // 5)
    out = impl(lhs, rhs, gs, ragged_dot_dimension_numbers=form)
    assert out.dtype == dtype
    assert_matches_oracle(out, lhs, rhs, gs, form)


ISA_TIERS = ["scalar", "avx2", "avx512", "avx512bf16", "amx"]


def _supported_tiers():
    best = tokamax_torch.device_kind().rsplit("_", 1)[1]
    return ISA_TIERS[: ISA_TIERS.index(best) + 1]


@pytest.mark.parametrize("isa", ISA_TIERS)
def test_every_isa_tier(isa, monkeypatch):
    if isa not in _supported_tiers():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("TOKAMAX_CPU_ISA", isa)
    for form in FORMS.values():
        lhs, rhs, gs = make_operands(form, 45, 33, 29, 4, torch.float32)
        assert_matches_oracle(rd.kernel(lhs, rhs, gs, ragged_dot_dimension_numbers=form), lhs, rhs, gs, form)


def test_preferred_element_type(impl):
    lhs, rhs, gs = make_operands(rd.DEFAULT, 40, 64, 24, 3, torch.bfloat16)
    out = impl(lhs, rhs, gs, preferred_element_type=torch.float32)
    assert out.dtype == torch.float32
    assert_matches_oracle(out, lhs, rhs, gs, tol=1e-5)
    assert impl(lhs, rhs, gs, preferred_element_type="float16").dtype == torch.float16


def poison_allocator(numel):
    """Frees a NaN-filled block of `numel` floats, so the next allocation of that size most
    likely reuses NaN memory: an element the op forgets to write then shows up."""
    blocks = [torch.full((numel,), float("nan")) for _ in range(4)]
    del blocks


def test_rows_past_total_are_exactly_zero(impl):
    lhs, rhs, _ = make_operands(rd.DEFAULT, 50, 16, 20, 3, torch.float32)
    gs = torch.tensor([10, 0, 15], dtype=torch.int32)
    poison_allocator(50 * 20)
    out = impl(lhs, rhs, gs)
    assert torch.equal(out[25:], torch.zeros(25, 20))
    assert_matches_oracle(out, lhs, rhs, gs)


@pytest.mark.parametrize("sizes", [[0, 0, 0], [0, 30, 0], [30, 0, 0], [0, 0, 30]], ids=str)
def test_empty_groups(impl, sizes):
    gs = torch.tensor(sizes, dtype=torch.int32)
    lhs = torch.randn(30, 12)
    rhs = torch.randn(3, 12, 9)
    assert_matches_oracle(impl(lhs, rhs, gs), lhs, rhs, gs)
    drhs_in = torch.randn(30, 9)
    poison_allocator(3 * 12 * 9)
    drhs = impl(lhs, drhs_in, gs, ragged_dot_dimension_numbers=rd.RAGGED_CONTRACTING)
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(drhs[g], torch.zeros(12, 9))  # exact zeros, never garbage
    assert_matches_oracle(drhs, lhs, drhs_in, gs, rd.RAGGED_CONTRACTING)


def test_int64_group_sizes(impl):
    lhs, rhs, gs = make_operands(rd.DEFAULT, 20, 8, 8, 3, torch.float32)
    assert torch.equal(impl(lhs, rhs, gs.long()), impl(lhs, rhs, gs))


def test_strided_inputs(impl):
    m, k, n, g = 40, 24, 36, 3
    gs = random_group_sizes(m, g)
    lhs = torch.randn(k, m).T                      # transposed view
    rhs = torch.randn(g, n, k).transpose(1, 2)     # [G, K, N] with K contiguous
    assert not lhs.is_contiguous() and not rhs.is_contiguous()
    assert_matches_oracle(impl(lhs, rhs, gs), lhs, rhs, gs)
    lhs_sliced = torch.randn(m, 2 * k)[:, ::2]     # column stride 2
    rhs_sliced = torch.randn(g, k, n + 5)[:, :, 3 : 3 + n]
    assert_matches_oracle(impl(lhs_sliced, rhs_sliced, gs), lhs_sliced, rhs_sliced, gs)
    expanded = torch.randn(1, k, n).expand(g, k, n)  # zero stride
    assert_matches_oracle(impl(lhs, expanded, gs), lhs, expanded, gs)
    dout = torch.randn(n, m).T
    assert_matches_oracle(
        impl(lhs, dout, gs, ragged_dot_dimension_numbers=rd.RAGGED_CONTRACTING), lhs, dout, gs, rd.RAGGED_CONTRACTING
    )


@pytest.mark.parametrize("m,k,n,g", [(0, 8, 8, 2), (8, 0, 8, 2), (8, 8, 0, 2), (8, 8, 8, 0)])
def test_zero_sizes(impl, m, k, n, g):
    for form in FORMS.values():
        lhs, rhs, gs = make_operands(form, m, k, n, g, torch.float32, total=0 if g == 0 else None)
        out = impl(lhs, rhs, gs, ragged_dot_dimension_numbers=form)
        assert_matches_oracle(out, lhs, rhs, gs, form)
        assert not out.isnan().any()


def test_unknown_isa_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TOKAMAX_CPU_ISA", "sse9")
    lhs, rhs, gs = make_operands(rd.DEFAULT, 8, 4, 4, 2, torch.float32)
    with pytest.raises(RuntimeError, match="TOKAMAX_CPU_ISA: expected one of 'scalar', 'avx2', 'avx512', 'avx512bf16', 'amx', got 'sse9'"):
        rd.kernel(lhs, rhs, gs)


# ---- autograd -----------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("impl,num_threads", IMPLEMENTATIONS_AT_THREAD_COUNTS, ids=IMPLEMENTATION_IDS,
                         indirect=["num_threads"])
def test_gradients_match_reference(impl, num_threads, form):
    lhs, rhs, gs = make_operands(form, 50, 20, 30, 4, torch.float32, total=44)
    gs[1] = 0
    gs[2] = 44 - gs[0] - gs[3]
    lhs.requires_grad_(True)
    rhs.requires_grad_(True)
    out = impl(lhs, rhs, gs, ragged_dot_dimension_numbers=form)
    dout = torch.randn_like(out)
    dlhs, drhs = torch.autograd.grad(out, (lhs, rhs), dout)
    l64, r64 = lhs.detach().double().requires_grad_(), rhs.detach().double().requires_grad_()
    want = rd.reference(l64, r64, gs, ragged_dot_dimension_numbers=form)
    want_dlhs, want_drhs = torch.autograd.grad(want, (l64, r64), dout.double())
    torch.testing.assert_close(dlhs.double(), want_dlhs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(drhs.double(), want_drhs, rtol=1e-4, atol=1e-4)
    if form == rd.DEFAULT:
        assert torch.equal(drhs[1], torch.zeros_like(drhs[1]))  # empty group: exact-zero grad
        assert torch.equal(dlhs[44:], torch.zeros_like(dlhs[44:]))  # rows past the total


# One thread: thousands of tiny calls, whose thread barriers stall on a loaded machine.
@pytest.mark.parametrize("num_threads", [1], ids=["1thread"], indirect=True)
def test_gradcheck_float64(impl, num_threads):
    for form in FORMS.values():
        lhs, rhs, gs = make_operands(form, 9, 4, 5, 3, torch.float64, total=8)
        lhs.requires_grad_(True)
        rhs.requires_grad_(True)
        fn = lambda a, b: impl(a, b, gs, ragged_dot_dimension_numbers=form)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (lhs, rhs))
        assert torch.autograd.gradgradcheck(fn, (lhs, rhs))


def test_bf16_gradients_with_fp32_output(impl):
    lhs, rhs, gs = make_operands(rd.DEFAULT, 32, 16, 24, 2, torch.bfloat16)
    lhs.requires_grad_(True)
    rhs.requires_grad_(True)
    out = impl(lhs, rhs, gs, preferred_element_type=torch.float32)
    out.sum().backward()
    assert lhs.grad.dtype == torch.bfloat16 and rhs.grad.dtype == torch.bfloat16
    want = oracle(torch.ones(32, 24), rhs.detach(), gs, rd.TRANS_RHS)
    assert (lhs.grad.double() - want).abs().max() / want.abs().max() < 1e-2


# ---- configs ------------------------------------------------------------------------------------

def test_get_configs():
    lhs, rhs, gs = make_operands(rd.DEFAULT, 64, 32, 48, 4, torch.float32)
    fwd, bwd = tokamax_torch.get_configs(rd.kernel, lhs, rhs, gs)
    assert isinstance(fwd, rd.Config) and isinstance(bwd, rd.BackwardConfig)
    assert bwd.dlhs == rd.kernel.config_space(lhs, rhs, gs, product="dlhs")[0]
    assert bwd.drhs == rd.kernel.config_space(lhs, rhs, gs, product="drhs")[0]
    assert tokamax_torch.get_configs(rd.reference, lhs, rhs, gs) == (None, None)
    assert tokamax_torch.get_configs(rd.kernel, lhs, rhs, gs, from_autotuning_cache=True) == (fwd, bwd)
    # Meta tensors: configs for shapes that cannot be allocated here.
    big = tokamax_torch.get_configs(
        rd.kernel,
        torch.empty(262144, 7168, dtype=torch.bfloat16, device="meta"),
        torch.empty(8, 7168, 2048, dtype=torch.bfloat16, device="meta"),
        torch.empty(8, dtype=torch.int32, device="meta"),
    )
    assert isinstance(big[0], rd.Config) and isinstance(big[1], rd.BackwardConfig)


def test_one_config_or_two_for_the_gradient_products():
    # bwd as one Config (both gradient products), as a BackwardConfig and as a flat list of both.
    # Long contractions in both gradient products (N=700 for dlhs, 300 rows per group for drhs),
    # so a different block_k changes the summation order of each.
    lhs, rhs, gs = make_operands(rd.DEFAULT, 600, 64, 700, 2, torch.float32)
    lhs.requires_grad_(True)
    rhs.requires_grad_(True)
    dout = torch.randn(600, 700)
    want = torch.autograd.grad(rd.reference(lhs, rhs, gs), (lhs, rhs), dout)
    heuristic = torch.autograd.grad(rd.kernel(lhs, rhs, gs), (lhs, rhs), dout)
    shallow = rd.Config(block_m=12, block_k=32, block_n=64, task_m=48, pack_b_min_rows=0)
    other = rd.Config(block_m=72, block_k=256, block_n=256, task_m=144, pack_b_min_rows=96)
    for bwd in (shallow, rd.BackwardConfig(shallow, other), shallow.to_list() + other.to_list()):
        got = torch.autograd.grad(rd.kernel(lhs, rhs, gs, configs=(None, bwd)), (lhs, rhs), dout)
        for x, y, h in zip(got, want, heuristic):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
            assert not torch.equal(x, h)  # the config reached this gradient product


def test_config_elements_must_be_ints():
    lhs, rhs, gs = make_operands(rd.DEFAULT, 16, 8, 8, 2, torch.float32)
    for bad in ("abc", ["144", 256, 512, 144, 12], [6.0, 8, 16, 6, 0], [True, 8, 16, 6, 0]):
        with pytest.raises(TypeError, match="a config must be a Config, a sequence of ints or None"):
            rd.kernel(lhs, rhs, gs, configs=(bad, None))


def test_invalid_config_rejected():
    # At the call, for both singletons, eager and compiled: CONTRACT.invalid_configs.
    with pytest.raises(RuntimeError, match="block_m must be a multiple of 6"):
        rd.Config(block_m=0, block_k=256, block_n=512, task_m=144, pack_b_min_rows=12)
    with pytest.raises(RuntimeError, match="block_n"):
        rd.Config(block_m=6, block_k=256, block_n=10**9, task_m=6, pack_b_min_rows=12)
    with pytest.raises(TypeError, match="block_k must be an int"):
        rd.Config(block_m=6, block_k=2.5, block_n=16, task_m=6, pack_b_min_rows=12)


# ---- property tests (run by tests/test_properties.py) ---------------------------------------

@st.composite
def ragged_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    form = draw(st.sampled_from(list(FORMS.values())))
    dtype = draw(st.sampled_from(DTYPES))
    m, k, n = (draw(st.integers(0, 70), label=d) for d in "mkn")
    g = draw(st.integers(0, 5), label="g")
    # Group sizes summing to at most m: rows past their total are left to the kernel to zero.
    cuts = sorted(draw(st.lists(st.integers(0, m), min_size=g, max_size=g), label="cuts"))
    sizes = [b - a for a, b in zip([0] + cuts, cuts)]
    group_sizes = torch.tensor(sizes, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    lhs = layout(draw, (m, k), generator, dtype, "lhs")
    rhs_shape = {rd.DEFAULT: (g, k, n), rd.TRANS_RHS: (g, n, k), rd.RAGGED_CONTRACTING: (m, n)}[form]
    rhs = layout(draw, rhs_shape, generator, dtype, "rhs")
    preferred = draw(st.sampled_from([None, torch.float32, dtype]))
    return lhs, rhs, group_sizes, form, preferred


@settings(PROFILE, max_examples=400)
@given(problem=ragged_problems())
def ragged_dot_kernel_matches_float64_oracle(problem):
    lhs, rhs, group_sizes, form, preferred = problem
    out = rd.kernel(lhs, rhs, group_sizes, ragged_dot_dimension_numbers=form, preferred_element_type=preferred)
    assert out.dtype == (preferred or lhs.dtype)
    assert not out.isnan().any()
    # fp32 output of bf16/fp16 inputs: accumulated in fp32, no output rounding.
    tol = 2e-5 if out.dtype == torch.float32 else None
    assert_matches_oracle(out, lhs, rhs, group_sizes, form, tol=tol)


PROPERTIES = [ragged_dot_kernel_matches_float64_oracle]


# ---- the op contract (tests/test_op_contract.py) ------------------------------------------------

def _sample(form, dtype, m=24, k=16, n=20, g=3, total=20, grad=(True, True), **kwargs):
    def make():
        lhs, rhs, gs = make_operands(form, m, k, n, g, dtype, total=total)
        return (lhs.requires_grad_(grad[0]), rhs.requires_grad_(grad[1]), gs), {
            "ragged_dot_dimension_numbers": form, **kwargs}
    return make


def _bad_inputs():
    gs = torch.tensor([3, 5], dtype=torch.int32)
    lhs, rhs = torch.randn(8, 4), torch.randn(2, 4, 6)
    return [
        BadInput("lhs must be 2-D", (torch.randn(2, 8, 4), rhs, gs)),
        BadInput("rhs must be 3-D", (lhs, torch.randn(4, 6), gs)),
        BadInput(r"rhs.shape\[1\] \(K\) must equal lhs.shape\[1\] = 4, got 5", (lhs, torch.randn(2, 5, 6), gs)),
        BadInput(r"rhs.shape\[0\] \(G\) must equal group_sizes.shape\[0\] = 2, got 3", (lhs, torch.randn(3, 4, 6), gs)),
        BadInput(r"sum\(group_sizes\) must be at most the number of rows of lhs \(8\), got 9",
                 (lhs, rhs, torch.tensor([4, 5], dtype=torch.int32))),
        BadInput(r"group_sizes must be non-negative, got group_sizes\[1\] = -1",
                 (lhs, rhs, torch.tensor([3, -1], dtype=torch.int32))),
        BadInput("group_sizes must be int32 or int64, got Float", (lhs, rhs, gs.float())),
        BadInput("group_sizes must be 1-D", (lhs, rhs, gs[None])),
        BadInput("lhs and rhs must have the same dtype, got Float and BFloat16", (lhs, rhs.bfloat16(), gs)),
        BadInput("lhs must be float32, bfloat16, float16 or float64, got Int", (lhs.int(), rhs.int(), gs)),
        BadInput("ragged_dot_dimension_numbers must be one of", (lhs, rhs, gs),
                 {"ragged_dot_dimension_numbers": (1, 1, 0, 0, 1, 1, 0, 0, 0, 0)}),
        BadInput(r"rhs.shape\[0\] \(M\) must equal lhs.shape\[0\] = 8, got 7", (lhs, torch.randn(7, 6), gs),
                 {"ragged_dot_dimension_numbers": rd.RAGGED_CONTRACTING}),
        BadInput("preferred_element_type must be float32, bfloat16, float16 or float64, got Int", (lhs, rhs, gs),
                 {"preferred_element_type": torch.int32}),
    ]


def _dynamic_rows(m):
    lhs, rhs = torch.randn(m, 12, requires_grad=True), torch.randn(4, 12, 20, requires_grad=True)
    return (lhs, rhs, random_group_sizes(m, 4)), {}


_CONFIG = [6, 8, 16, 12, 4]


CONTRACT = OpContract(
    name="ragged_dot",
    reference=rd.reference,
    kernel=rd.kernel,
    samples=[
        *(Sample(f"{name}-{str(dtype)[6:]}", _sample(form, dtype), compile=dtype == torch.float32)
          for name, form in FORMS.items() for dtype in (torch.float32, torch.bfloat16)),
        Sample("configs-fp32-out", _sample(rd.DEFAULT, torch.float32, grad=(True, False),
                                           preferred_element_type=torch.float32, configs=(_CONFIG, _CONFIG))),
        # Tiny groups, whose gradient products get very different heuristics.
        *(Sample(f"tiny-groups-{name}", _sample(form, torch.float32, 12, 200, 100, 4, total=None), compile=False,
                 reference=False) for name, form in FORMS.items()),
        Sample("long-k", _sample(rd.TRANS_RHS, torch.float32, 100, 300, 64, 3, total=None), reference=False),
    ],
    bad_inputs=_bad_inputs,
    invalid_configs=[
        ("expected 5 values", ([6, 8], None)),
        ("task_m", ([6, 8, 16, 7, 0], None)),
        ("config: ragged_dot config: block_m", ([0, 8, 16, 6, 0], None)),
        ("bwd_config must hold 5 values", (None, [6, 8, 16])),
        ("bwd_config: ragged_dot config: block_n", (None, [6, 8, 16, 6, 0, 6, 8, 17, 6, 0])),
    ],
    config_samples={
        # Long contractions: K for the forward; N = 400 for dlhs and 150 rows per group for drhs.
        "forward": Sample("long-k", _sample(rd.DEFAULT, torch.float32, 120, 1000, 64, 2, total=None)),
        "dlhs": Sample("long-n", _sample(rd.DEFAULT, torch.float32, 300, 48, 400, 2, total=None)),
        "drhs": Sample("long-groups", _sample(rd.DEFAULT, torch.float32, 300, 48, 400, 2, total=None)),
    },
    dynamic=[DynamicSizes("rows", _dynamic_rows, [{"m": 16}, {"m": 24}, {"m": 40}], {"m": (2, 4096)},
                          lambda dims: ({0: dims["m"]}, None, None))],
    determinism_samples=[
        Sample("default", _sample(rd.DEFAULT, torch.float32, 300, 500, 200, 6, total=None)),
        Sample("bf16-trans-rhs", _sample(rd.TRANS_RHS, torch.bfloat16, 300, 200, 100, 5, total=280)),
    ],
)
