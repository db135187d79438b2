"""fused_moe: the router (softmax, top-k with ties to the lowest id, renormalisation) and the
experts against a float64 oracle, forward and every gradient (gating included), its errors, its
CONTRACT and its property test. The experts' oracle is test_fused_experts.py's."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import DTYPES, PROFILE, layout
from test_fused_experts import TOLERANCE as EXPERTS_TOLERANCE
from test_fused_experts import check_pre_activations_saved_only_with_grad
from test_fused_experts import oracle as experts_oracle
from test_fused_experts import weights
from tokamax_torch.ops import fused_moe as fm

# The router runs in fp32 for every dtype (its weights are fp32), so float64 calls are fp32-exact
# in the routing weights.
TOLERANCE = {**EXPERTS_TOLERANCE, torch.float64: 1e-6}


def router_oracle(gating, topk, renormalize=True):
    """float64 softmax, stable descending sort (ties keep the lower id first), first topk."""
    probs = gating.double().softmax(1)
    ids = probs.detach().sort(dim=1, descending=True, stable=True).indices[:, :topk]
    w = probs.gather(1, ids)
    return (w / w.sum(1, keepdim=True) if renormalize else w), ids


def oracle(x, w1, w2, gating, topk, renormalize=True, act_fn="silu", w1_bias=None, w2_bias=None):
    w, ids = router_oracle(gating, topk, renormalize)
    return experts_oracle(x, w1, w2, w, ids, act_fn, w1_bias, w2_bias)


def problem(tokens=13, hidden=24, inter=20, experts=4, topk=2, dtype=torch.float32, transposed=True, bias=False,
            act_fn="silu", renormalize=True, gating_dtype=None, seed=0, grad=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w1, w2, b1, b2 = weights(experts, hidden, inter, dtype, gen, transposed, bias)
    gating = torch.randn(tokens, experts, generator=gen).to(gating_dtype or dtype)
    kwargs = {"topk": topk, "renormalize": renormalize, "act_fn": act_fn}
    if bias:
        kwargs.update(w1_bias=b1, w2_bias=b2)
    if grad:
        for t in (x, w1, w2, gating, b1, b2):
            if t is not None:
                t.requires_grad_(True)
    return (x, w1, w2, gating), kwargs


def check_against_oracle(impl, args, kwargs, tol):
    leaves = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    out = impl(*args, **kwargs)
    plain = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
    torch.testing.assert_close(out.double(), oracle(*map(plain, args), **{k: plain(v) for k, v in kwargs.items()}),
                               rtol=tol, atol=tol)
    dout = torch.randn(out.shape[1], out.shape[0]).to(out.dtype).t()
    got = torch.autograd.grad(out, leaves, dout)
    fresh = {id(t): t.detach().double().requires_grad_(True) for t in leaves}
    swap = lambda v: fresh.get(id(v), v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    want = torch.autograd.grad(oracle(*map(swap, args), **{k: swap(v) for k, v in kwargs.items()}),
                               [fresh[id(t)] for t in leaves], dout.double())
    for g, w, leaf in zip(got, want, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
        scale = max(w.abs().max().item(), 1.0)
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol * scale)


IMPLS = [(fm.reference, None)] + [(fm.kernel, n) for n in THREAD_COUNTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("impl,num_threads", IMPLS, indirect=["num_threads"])
def test_forward_and_gradients_match_float64_oracle(impl, num_threads, dtype):
    args, kwargs = problem(tokens=31, hidden=300, inter=140, experts=6, topk=3, dtype=dtype, seed=1)
    check_against_oracle(impl, args, kwargs, TOLERANCE[dtype])


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("act_fn", ["silu", "gelu"])
@pytest.mark.parametrize("impl", [fm.reference, fm.kernel], ids=["reference", "kernel"])
def test_options_biases_and_bf16_gating(impl, act_fn, renormalize):
    args, kwargs = problem(tokens=17, hidden=40, inter=24, experts=5, topk=2, bias=True, act_fn=act_fn,
                           renormalize=renormalize, seed=2)
    check_against_oracle(impl, args, kwargs, TOLERANCE[torch.float32])
    args, kwargs = problem(tokens=9, hidden=16, inter=8, experts=4, topk=3, gating_dtype=torch.bfloat16, seed=3)
    check_against_oracle(impl, args, kwargs, TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("impl", [fm.reference, fm.kernel], ids=["reference", "kernel"])
def test_ties_go_to_the_lowest_id_and_weights_are_probabilities(impl):
    (x, w1, w2, _), _ = problem(tokens=3, hidden=8, inter=4, experts=4, grad=False)
    gating = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 2.0, 2.0], [5.0, -1.0, 5.0, 0.0]])
    for renormalize in (True, False):
        out = impl(x, w1, w2, gating, topk=2, renormalize=renormalize)
        probs = gating.double().softmax(1)
        ids = torch.tensor([[0, 1], [1, 2], [0, 2]])
        w = probs.gather(1, ids)  # softmax probabilities, never the raw logits
        w = w / w.sum(1, keepdim=True) if renormalize else w
        torch.testing.assert_close(out.double(), experts_oracle(x, w1, w2, w, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_threads", [1], indirect=True)
def test_gradcheck_float64_experts_side(num_threads):
    # The router is fp32 (its weights are), so only the float64 paths are checked numerically.
    args, kwargs = problem(tokens=4, hidden=3, inter=2, experts=3, topk=2, dtype=torch.float64, bias=True,
                           act_fn="gelu", grad=True)
    x, w1, w2, gating = args
    assert torch.autograd.gradcheck(
        lambda x, w1, w2, b1, b2: fm.kernel(x, w1, w2, gating.detach(), topk=2, act_fn="gelu", w1_bias=b1,
                                            w2_bias=b2),
        (x, w1, w2, kwargs["w1_bias"], kwargs["w2_bias"]))


def test_unused_experts_get_exact_zero_gradients():
    args, kwargs = problem(tokens=6, hidden=8, inter=4, experts=5, topk=2, bias=True)
    x, w1, w2, _ = args
    gating = torch.tensor([[3.0, 0.0, 2.0, 0.0, 0.0]] * 6)  # experts 0 and 2 only
    fm.kernel(x, w1, w2, gating, **kwargs).sum().backward()
    for grad in (w1.grad, w2.grad, kwargs["w1_bias"].grad, kwargs["w2_bias"].grad):
        assert (grad[[1, 3, 4]] == 0).all() and (grad[[0, 2]] != 0).any()


# ---- the contract ----------------------------------------------------------------------------

@pytest.mark.parametrize("grad_enabled", [False, True])
def test_only_a_call_that_can_be_differentiated_saves_pre_activations(grad_enabled):
    args, kwargs = problem()
    check_pre_activations_saved_only_with_grad(lambda: fm.kernel(*args, **kwargs), "fused_moe", grad_enabled)


def _sample(**kwargs):
    return lambda: problem(**kwargs)


def _bad_inputs():
    (x, w1, w2, gating), _ = problem(tokens=3, hidden=8, inter=4, experts=4, grad=False)
    ok = (x, w1, w2, gating)
    return [
        BadInput(r"fused_moe: x must be 2-D \[T, H\], got shape \[24\]", (x.view(-1), w1, w2, gating), {"topk": 2}),
        BadInput("fused_moe: w2 must have x's dtype Float, got Half", (x, w1, w2.half(), gating), {"topk": 2}),
        BadInput(r"fused_moe: gating must be \[T, E\] = \[3, 4\], got shape \[3, 5\]",
                 (x, w1, w2, torch.zeros(3, 5)), {"topk": 2}),
        BadInput(r"fused_moe: gating must be a 2-D \[T, E\] float tensor, got Long",
                 (x, w1, w2, gating.long()), {"topk": 2}),
        BadInput(r"fused_moe: topk must be in \[1, E=4\], got 5", ok, {"topk": 5}),
        BadInput(r"fused_moe: topk must be in \[1, E=4\], got 0", ok, {"topk": 0}),
        BadInput(r"fused_moe: act_fn must be \"silu\" or \"gelu\" \(tanh approximation\), got \"gelu_new\"", ok,
                 {"topk": 2, "act_fn": "gelu_new"}),
        BadInput(r"fused_moe: w2_bias must be \[4, 8\], got shape \[4, 7\]", ok,
                 {"topk": 2, "w2_bias": torch.zeros(4, 7)}),
    ]


CONTRACT = OpContract(
    name="fused_moe",
    reference=fm.reference,
    kernel=fm.kernel,
    samples=[
        Sample("fp32-hf-views", _sample()),
        Sample("bf16-bias-gelu-no-renorm", _sample(dtype=torch.bfloat16, bias=True, act_fn="gelu", renormalize=False),
               compile=False),
        Sample("fp16-contiguous-top1-fp32-gating", _sample(dtype=torch.float16, transposed=False, topk=1,
                                                           gating_dtype=torch.float32), compile=False),
    ],
    bad_inputs=_bad_inputs,
    invalid_configs=[
        ("expected 4 values", ([96], None)),
        ("config: fused_moe config: task_rows must be", ([0, 256, 512, 96], None)),
        ("bwd_config: fused_moe config: block_n", (None, [96, 256, 8, 96])),
    ],
    config_samples={"forward": Sample("deep", _sample(tokens=20, hidden=600, inter=300, experts=3)),
                    "backward": Sample("deep", _sample(tokens=20, hidden=600, inter=300, experts=3))},
    # T symbolic; its sizes differ from H=24, 2I=40, E=4 and topk=2.
    dynamic=[DynamicSizes("tokens", lambda t: problem(tokens=t),
                          [{"t": 5}, {"t": 9}, {"t": 17}], {"t": (2, 4096)},
                          lambda dims: ({0: dims["t"]}, None, None, {0: dims["t"]}))],
    determinism_samples=[Sample("many-tokens", _sample(tokens=400, hidden=300, inter=64, experts=6, topk=2)),
                         Sample("bf16-bias", _sample(tokens=300, hidden=64, inter=140, experts=8, topk=3,
                                                     dtype=torch.bfloat16, bias=True))],
)


# ---- property test -----------------------------------------------------------------------------

@st.composite
def fused_moe_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    tokens, hidden = draw(st.integers(0, 20), label="T"), draw(st.integers(1, 70), label="H")
    inter, experts = draw(st.integers(1, 40), label="I"), draw(st.integers(1, 6), label="E")
    topk = draw(st.integers(1, experts), label="topk")
    x = layout(draw, (tokens, hidden), generator, dtype, "x")
    w1, w2, b1, b2 = weights(experts, hidden, inter, dtype, generator, draw(st.booleans(), label="hf views"),
                             draw(st.booleans(), label="bias"))
    gating = layout(draw, (tokens, experts), generator, draw(st.sampled_from(DTYPES)), "gating")
    return (x, w1, w2, gating, topk, draw(st.booleans(), label="renormalize"),
            draw(st.sampled_from(["silu", "gelu"])), b1, b2)


@settings(PROFILE, max_examples=60)
@given(problem=fused_moe_problems())
def fused_moe_kernel_matches_float64_oracle(problem):
    x, w1, w2, gating, topk, renormalize, act_fn, b1, b2 = problem
    out = fm.kernel(x, w1, w2, gating, topk=topk, renormalize=renormalize, act_fn=act_fn, w1_bias=b1, w2_bias=b2)
    tol = TOLERANCE[x.dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), oracle(x, w1, w2, gating, topk, renormalize, act_fn, b1, b2),
                               rtol=tol, atol=tol)


PROPERTIES = [fused_moe_kernel_matches_float64_oracle]
