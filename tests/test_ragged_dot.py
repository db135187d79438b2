"""The shared ragged_dot suite, run against both singletons (reference and kernel)."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tokamax_torch
from tokamax_torch.ops import ragged_dot as rd

IMPLEMENTATIONS = [rd.reference, rd.kernel]
# max|out - oracle| / max|oracle|, where the oracle is float64 math on the same (rounded) inputs;
# bf16/fp16 are dominated by the rounding of the output itself.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}


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
def test_matches_float64_oracle(impl, dtype, form, m, k, n, g):
    lhs, rhs, gs = make_operands(form, m, k, n, g, dtype, total=m - m // 5)
    out = impl(lhs, rhs, gs, ragged_dot_dimension_numbers=form)
    assert out.dtype == dtype
    assert_matches_oracle(out, lhs, rhs, gs, form)


ISA_TIERS = ["scalar", "avx2", "avx512", "avx512bf16", "amx"]


def _supported_tiers():
    best = tokamax_torch.device_kind().rsplit("_", 1)[1]
    return ISA_TIERS[: ISA_TIERS.index(best) + 1]


@pytest.mark.parametrize("isa", ISA_TIERS)
def test_every_isa_tier(impl, isa, monkeypatch):
    if isa not in _supported_tiers():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("TOKAMAX_CPU_ISA", isa)
    for form in FORMS.values():
        lhs, rhs, gs = make_operands(form, 45, 33, 29, 4, torch.float32)
        assert_matches_oracle(impl(lhs, rhs, gs, ragged_dot_dimension_numbers=form), lhs, rhs, gs, form)


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


def test_bitwise_deterministic_across_runs_and_threads(impl):
    lhs, rhs, gs = make_operands(rd.DEFAULT, 300, 500, 200, 6, torch.float32)
    first = impl(lhs, rhs, gs)
    assert torch.equal(first, impl(lhs, rhs, gs))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = impl(lhs, rhs, gs)
    finally:
        torch.set_num_threads(threads)
    if impl is rd.kernel:
        assert torch.equal(first, single)
    else:
        # The reference is at::mm per group: MKL's summation order may depend on the thread
        # count (on Zen 4 a 10-row group differs in the last bits between 1 and 2 threads), so
        # only the kernel promises bits across thread counts.
        torch.testing.assert_close(first, single, rtol=1e-5, atol=1e-5)


# ---- autograd -----------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_gradients_match_reference(impl, form):
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


def test_gradcheck_float64(impl):
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


# ---- torch.library / compile / export -----------------------------------------------------------

@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(impl, form, dtype):
    lhs, rhs, gs = make_operands(form, 24, 16, 20, 3, dtype, total=20)
    lhs.requires_grad_(True)
    rhs.requires_grad_(True)
    torch.library.opcheck(impl.op, (lhs, rhs, gs, form.flatten(), None, None, None))


def test_opcheck_with_configs(impl):
    lhs, rhs, gs = make_operands(rd.DEFAULT, 24, 16, 20, 3, torch.float32)
    cfg = [6, 8, 16, 12, 4]
    torch.library.opcheck(impl.op, (lhs.requires_grad_(), rhs, gs, None, torch.float32, cfg, cfg))


def test_compile_fullgraph_matches_eager(impl):
    lhs, rhs, gs = make_operands(rd.DEFAULT, 64, 32, 48, 4, torch.float32, total=60)

    def step(a, b):
        out = impl(torch.tanh(a), b * 2.0, gs)
        return (out.relu() ** 2).sum()

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        a, b = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
        loss = fn(a, b)
        loss.backward()
        results.append((loss.detach(), a.grad, b.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)


def test_compile_dynamic_one_graph(impl):
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def fn(a, b, gs):
        return impl(a, b, gs) * 1.5

    rhs = torch.randn(4, 12, 20)  # sizes that no M below equals (duck sizing would merge them)
    for m in (16, 24, 40):
        lhs = torch.randn(m, 12)
        gs = random_group_sizes(m, 4)
        torch.testing.assert_close(fn(lhs, rhs, gs), impl(lhs, rhs, gs) * 1.5)
    assert counter.frame_count == 1


def test_compile_backward_dynamic(impl):
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def fn(a, b, gs):
        return impl(a, b, gs).sum()

    rhs = torch.randn(3, 8, 12, requires_grad=True)
    for m in (10, 14, 22):  # distinct from K=8, N=12, G=3
        lhs = torch.randn(m, 8, requires_grad=True)
        gs = random_group_sizes(m, 3)
        fn(lhs, rhs, gs).backward()
        want = oracle(torch.ones(m, 12), rhs.detach(), gs, rd.TRANS_RHS)
        torch.testing.assert_close(lhs.grad.double(), want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_export_dynamic_m(impl):
    class Block(torch.nn.Module):
        def forward(self, a, b, gs):
            return impl(a, b, gs)

    lhs, rhs, gs = make_operands(rd.DEFAULT, 32, 16, 8, 4, torch.float32)
    m = torch.export.Dim("m", min=2, max=4096)
    exported = torch.export.export(Block(), (lhs, rhs, gs), dynamic_shapes=({0: m}, None, None))
    out_node = [n for n in exported.graph.nodes if n.op == "call_function"][-1]
    assert isinstance(out_node.meta["val"].shape[0], torch.SymInt)
    lhs2 = torch.randn(50, 16)
    gs2 = random_group_sizes(50, 4)
    torch.testing.assert_close(exported.module()(lhs2, rhs, gs2), impl(lhs2, rhs, gs2))


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


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("m,k,n,g", [(100, 300, 64, 3), (12, 200, 100, 4)])
def test_no_config_is_the_heuristic_config(impl, form, m, k, n, g):
    # (12, 200, 100, 4): tiny groups, whose gradient products get very different heuristics.
    lhs, rhs, gs = make_operands(form, m, k, n, g, torch.float32)
    lhs.requires_grad_(True)
    rhs.requires_grad_(True)
    configs = tokamax_torch.get_configs(impl, lhs, rhs, gs, ragged_dot_dimension_numbers=form)
    plain = impl(lhs, rhs, gs, ragged_dot_dimension_numbers=form)
    explicit = impl(lhs, rhs, gs, ragged_dot_dimension_numbers=form, configs=configs)
    assert torch.equal(plain, explicit)
    dout = torch.randn_like(plain)
    assert all(torch.equal(x, y) for x, y in zip(
        torch.autograd.grad(plain, (lhs, rhs), dout), torch.autograd.grad(explicit, (lhs, rhs), dout)))
    compiled = torch.compile(lambda a, b: impl(a, b, gs, ragged_dot_dimension_numbers=form), fullgraph=True)
    torch.testing.assert_close(compiled(lhs, rhs), plain)
    # Config dataclasses are constants to Dynamo: no graph break, same bits as eager.
    with_configs = torch.compile(
        lambda a, b: impl(a, b, gs, ragged_dot_dimension_numbers=form, configs=configs), fullgraph=True)
    assert torch.equal(with_configs(lhs, rhs), explicit)


def test_explicit_backward_configs_are_honoured():
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


def test_explicit_config_is_honoured():
    lhs, rhs, gs = make_operands(rd.DEFAULT, 120, 1000, 64, 2, torch.float32)
    heuristic = rd.kernel(lhs, rhs, gs)
    space = rd.kernel.config_space(lhs, rhs, gs)
    assert len(space) > 5 and space[0] == tokamax_torch.get_configs(rd.kernel, lhs, rhs, gs)[0]
    with pytest.raises(ValueError, match="product must be one of"):
        rd.kernel.config_space(lhs, rhs, gs, product="backward")
    outputs = []
    for cfg in space:
        out = rd.kernel(lhs, rhs, gs, configs=(cfg, None))
        assert torch.equal(out, rd.kernel(lhs, rhs, gs, configs=(cfg.to_list(), None)))
        assert_matches_oracle(out, lhs, rhs, gs)
        outputs.append(out)
    # A different K blocking sums in another order: some config must change the bits, which
    # shows the config reaches the kernel.
    assert any(not torch.equal(out, heuristic) for out in outputs)


def test_config_elements_must_be_ints():
    lhs, rhs, gs = make_operands(rd.DEFAULT, 16, 8, 8, 2, torch.float32)
    for bad in ("abc", ["144", 256, 512, 144, 12], [6.0, 8, 16, 6, 0], [True, 8, 16, 6, 0]):
        with pytest.raises(TypeError, match="a config must be a Config, a sequence of ints or None"):
            rd.kernel(lhs, rhs, gs, configs=(bad, None))


def test_invalid_config_rejected():
    with pytest.raises(RuntimeError, match="block_m must be a multiple of 6"):
        rd.Config(block_m=0, block_k=256, block_n=512, task_m=144, pack_b_min_rows=12)
    with pytest.raises(RuntimeError, match="block_n"):
        rd.Config(block_m=6, block_k=256, block_n=10**9, task_m=6, pack_b_min_rows=12)
    with pytest.raises(TypeError, match="block_k must be an int"):
        rd.Config(block_m=6, block_k=2.5, block_n=16, task_m=6, pack_b_min_rows=12)
    lhs, rhs, gs = make_operands(rd.DEFAULT, 16, 8, 8, 2, torch.float32)
    with pytest.raises(RuntimeError, match="expected 5 values"):
        rd.kernel(lhs, rhs, gs, configs=([6, 8], None))
    with pytest.raises(RuntimeError, match="task_m"):
        rd.kernel(lhs, rhs, gs, configs=([6, 8, 16, 7, 0], None))
    # Backward configs are checked at the forward call, for both singletons, not at backward.
    for impl in IMPLEMENTATIONS:
        with pytest.raises(RuntimeError, match="bwd_config must hold 5 values"):
            impl(lhs.requires_grad_(), rhs, gs, configs=(None, [6, 8, 16]))
        with pytest.raises(RuntimeError, match="bwd_config: ragged_dot config: block_n"):
            impl(lhs, rhs, gs, configs=(None, [6, 8, 16, 6, 0, 6, 8, 17, 6, 0]))
        with pytest.raises(RuntimeError, match="config: ragged_dot config: block_m"):
            impl(lhs, rhs, gs, configs=([0, 8, 16, 6, 0], None))
    compiled = torch.compile(lambda a: rd.kernel(a, rhs, gs, configs=([0, 8, 16, 6, 0], None)), fullgraph=True)
    with pytest.raises(Exception, match="block_m"):
        compiled(lhs)


# ---- bad inputs ---------------------------------------------------------------------------------

def _bad_inputs():
    f = torch.float32
    gs = torch.tensor([3, 5], dtype=torch.int32)
    return [
        ("lhs must be 2-D", (torch.randn(2, 8, 4), torch.randn(2, 4, 6), gs), {}),
        ("rhs must be 3-D", (torch.randn(8, 4), torch.randn(4, 6), gs), {}),
        (r"rhs.shape\[1\] \(K\) must equal lhs.shape\[1\] = 4, got 5", (torch.randn(8, 4), torch.randn(2, 5, 6), gs), {}),
        (r"rhs.shape\[0\] \(G\) must equal group_sizes.shape\[0\] = 2, got 3", (torch.randn(8, 4), torch.randn(3, 4, 6), gs), {}),
        (r"sum\(group_sizes\) must be at most the number of rows of lhs \(8\), got 9",
         (torch.randn(8, 4), torch.randn(2, 4, 6), torch.tensor([4, 5], dtype=torch.int32)), {}),
        (r"group_sizes must be non-negative, got group_sizes\[1\] = -1",
         (torch.randn(8, 4), torch.randn(2, 4, 6), torch.tensor([3, -1], dtype=torch.int32)), {}),
        ("group_sizes must be int32 or int64, got Float", (torch.randn(8, 4), torch.randn(2, 4, 6), gs.to(f)), {}),
        ("group_sizes must be 1-D", (torch.randn(8, 4), torch.randn(2, 4, 6), gs[None]), {}),
        ("lhs and rhs must have the same dtype, got Float and BFloat16",
         (torch.randn(8, 4), torch.randn(2, 4, 6, dtype=torch.bfloat16), gs), {}),
        ("lhs must be float32, bfloat16, float16 or float64, got Int",
         (torch.ones(8, 4, dtype=torch.int32), torch.ones(2, 4, 6, dtype=torch.int32), gs), {}),
        ("ragged_dot_dimension_numbers must be one of", (torch.randn(8, 4), torch.randn(2, 4, 6), gs),
         {"ragged_dot_dimension_numbers": (1, 1, 0, 0, 1, 1, 0, 0, 0, 0)}),
        (r"rhs.shape\[0\] \(M\) must equal lhs.shape\[0\] = 8, got 7", (torch.randn(8, 4), torch.randn(7, 6), gs),
         {"ragged_dot_dimension_numbers": rd.RAGGED_CONTRACTING}),
        ("preferred_element_type must be float32, bfloat16, float16 or float64, got Int",
         (torch.randn(8, 4), torch.randn(2, 4, 6), gs), {"preferred_element_type": torch.int32}),
    ]


@pytest.mark.parametrize("message,args,kwargs", _bad_inputs(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_before_compute(impl, message, args, kwargs):
    with pytest.raises(RuntimeError, match=message):
        impl(*args, **kwargs)


@pytest.mark.parametrize("message,args,kwargs", _bad_inputs()[:6], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_under_compile(impl, message, args, kwargs):
    compiled = torch.compile(lambda *a: impl(*a, **kwargs), fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(*args)
