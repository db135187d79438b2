"""fused_experts: a float64 oracle for the forward and every gradient (x, w1, w2, biases,
topk_weights), transposed weight views, experts with no tokens, its errors, its CONTRACT and its
property test. The oracle and the problem maker are shared with test_fused_moe.py."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import DTYPES, PROFILE, layout
from tokamax_torch.ops import fused_experts as fe

# The kernel rounds h (the GLU output) and, in the backward, [dgate|dup] and w*h to x's dtype
# before their second product, as the unfused composition does; fp32 sums elsewhere.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float64: 1e-10}


def act(name, g):
    if name == "silu":
        return g * torch.sigmoid(g)
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))


def oracle(x, w1, w2, topk_weights, topk_ids, act_fn="silu", w1_bias=None, w2_bias=None):
    """float64, one expert at a time over its (token, slot) pairs; differentiable (float64 autograd
    gives the gradients' oracle)."""
    x, w1, w2, tw = x.double(), w1.double(), w2.double(), topk_weights.double()
    inter = w2.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(w1.shape[0]):
        tokens, slots = torch.where(topk_ids.long() == e)
        if tokens.numel() == 0:
            continue
        pre = x[tokens] @ w1[e]
        if w1_bias is not None:
            pre = pre + w1_bias[e].double()
        y = (act(act_fn, pre[:, :inter]) * pre[:, inter:]) @ w2[e]
        if w2_bias is not None:
            y = y + w2_bias[e].double()
        out = out.index_add(0, tokens, tw[tokens, slots, None] * y)
    return out


def weights(experts, hidden, inter, dtype, generator, transposed=True, bias=False):
    """w1[E, H, 2I], w2[E, I, H] (as Hugging Face stores them, transposed views by default) and biases."""
    if transposed:
        w1 = (torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5).to(dtype).transpose(1, 2)
        w2 = (torch.randn(experts, hidden, inter, generator=generator) / max(inter, 1)**0.5).to(dtype).transpose(1, 2)
    else:
        w1 = (torch.randn(experts, hidden, 2 * inter, generator=generator) / hidden**0.5).to(dtype)
        w2 = (torch.randn(experts, inter, hidden, generator=generator) / max(inter, 1)**0.5).to(dtype)
    b1 = (torch.randn(experts, 2 * inter, generator=generator) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(experts, hidden, generator=generator) * 0.1).to(dtype) if bias else None
    return w1, w2, b1, b2


def routing(tokens, experts, k, generator, weight_dtype=torch.float32, id_dtype=torch.int64):
    """k distinct experts per token (random), softmax-like weights."""
    ids = torch.rand(tokens, experts, generator=generator).argsort(1)[:, :k].to(id_dtype)
    tw = torch.rand(tokens, k, generator=generator).softmax(1).to(weight_dtype)
    return tw, ids


def problem(tokens=13, hidden=24, inter=20, experts=4, k=2, dtype=torch.float32, transposed=True, bias=False,
            act_fn="silu", weight_dtype=torch.float32, id_dtype=torch.int64, seed=0, grad=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w1, w2, b1, b2 = weights(experts, hidden, inter, dtype, gen, transposed, bias)
    tw, ids = routing(tokens, experts, k, gen, weight_dtype, id_dtype)
    args = [x, w1, w2, tw, ids]
    kwargs = {"act_fn": act_fn}
    if bias:
        kwargs.update(w1_bias=b1, w2_bias=b2)
    if grad:
        for t in (x, w1, w2, tw, b1, b2):
            if t is not None:
                t.requires_grad_(True)
    return tuple(args), kwargs


def check_against_oracle(impl, args, kwargs, tol, leaves):
    out = impl(*args, **kwargs)
    want = oracle(*[a.detach() if a.is_floating_point() else a for a in args],
                  **{k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    dout = torch.randn(out.shape[1], out.shape[0]).to(out.dtype).t()  # strided
    got = torch.autograd.grad(out, leaves, dout)
    fresh = [t.detach().double().requires_grad_(True) for t in leaves]
    names = {id(t): i for i, t in enumerate(leaves)}
    oracle_args = [fresh[names[id(a)]] if id(a) in names else a for a in args]
    oracle_kwargs = {k: fresh[names[id(v)]] if id(v) in names else v for k, v in kwargs.items()}
    want_grads = torch.autograd.grad(oracle(*oracle_args, **oracle_kwargs), fresh, dout.double())
    for g, w, leaf in zip(got, want_grads, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
        scale = max(w.abs().max().item(), 1.0)
        leaf_tol = max(tol, TOLERANCE[leaf.dtype])  # fp32 routing weights get fp32 gradients
        torch.testing.assert_close(g.double(), w, rtol=leaf_tol, atol=leaf_tol * scale)


IMPLS = [(fe.reference, None)] + [(fe.kernel, n) for n in THREAD_COUNTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("impl,num_threads", IMPLS, indirect=["num_threads"])
def test_forward_and_gradients_match_float64_oracle(impl, num_threads, dtype):
    # H and I past one 256-deep K slice, odd T, weights as Hugging Face's transposed views.
    args, kwargs = problem(tokens=29, hidden=300, inter=140, experts=5, k=3, dtype=dtype, seed=1)
    check_against_oracle(impl, args, kwargs, TOLERANCE[dtype], [args[0], args[1], args[2], args[3]])


@pytest.mark.parametrize("act_fn", ["silu", "gelu"])
@pytest.mark.parametrize("transposed", [True, False], ids=["hf-views", "contiguous"])
@pytest.mark.parametrize("impl", [fe.reference, fe.kernel], ids=["reference", "kernel"])
def test_biases_activations_and_layouts(impl, act_fn, transposed):
    args, kwargs = problem(tokens=17, hidden=40, inter=24, experts=4, k=2, bias=True, act_fn=act_fn,
                           transposed=transposed, seed=2)
    x = torch.randn(40, 34).t()[::2].requires_grad_(True)  # a strided x
    args = (x,) + args[1:]
    leaves = [args[0], args[1], args[2], args[3], kwargs["w1_bias"], kwargs["w2_bias"]]
    check_against_oracle(impl, args, kwargs, TOLERANCE[torch.float32], leaves)


def test_decode_blocking_follows_the_weights_layout():
    """16-bit weights read in place by decode-sized tasks get the GEMM core's streaming blocking;
    transposed (Hugging Face) views are packed and keep the packed one; fp32 keeps it too. The
    cache key tells the layouts apart."""
    x = torch.randn(4, 256).bfloat16()
    w1 = torch.randn(8, 256, 2 * 128).bfloat16()
    w2 = torch.randn(8, 128, 256).bfloat16()
    v1, v2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w1, w2))
    ids = torch.randint(0, 8, (4, 2))
    weights = torch.rand(4, 2)
    contiguous = fe.kernel.get_configs(x, w1, w2, weights, ids)[0]
    views = fe.kernel.get_configs(x, v1, v2, weights, ids)[0]
    fp32 = fe.kernel.get_configs(x.float(), w1.float(), w2.float(), weights, ids)[0]
    # The streaming blocking's numbers are per machine class (Zen 4 keeps 256-deep slices for
    # bf16, others take 32); every class gives it 1024-wide blocks against the packed 512.
    blocking = lambda c: (c.block_k, c.block_n)  # noqa: E731
    assert blocking(contiguous) != blocking(views) and blocking(views) == blocking(fp32)
    assert fe.kernel.cache_key(x, w1, w2, weights, ids)["weights_in_place"] is True
    assert fe.kernel.cache_key(x, v1, v2, weights, ids)["weights_in_place"] is False
    torch.testing.assert_close(fe.kernel(x, w1, w2, weights, ids).float(), fe.kernel(x, v1, v2, weights, ids).float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("num_threads", [1], indirect=True)
def test_gradcheck_float64(num_threads):
    args, kwargs = problem(tokens=4, hidden=3, inter=2, experts=3, k=2, dtype=torch.float64,
                           weight_dtype=torch.float64, bias=True, act_fn="gelu", grad=True)
    x, w1, w2, tw, ids = args
    assert torch.autograd.gradcheck(
        lambda x, w1, w2, tw, b1, b2: fe.kernel(x, w1, w2, tw, ids, act_fn="gelu", w1_bias=b1, w2_bias=b2),
        (x, w1, w2, tw, kwargs["w1_bias"], kwargs["w2_bias"]))


@pytest.mark.parametrize("impl", [fe.reference, fe.kernel], ids=["reference", "kernel"])
def test_experts_with_no_tokens_get_exact_zero_gradients(impl):
    args, kwargs = problem(tokens=6, hidden=8, inter=4, experts=5, k=2, bias=True)
    x, w1, w2, tw, ids = args
    ids = torch.tensor([[0, 2]] * 6)  # experts 1, 3 and 4 get nothing
    impl(x, w1, w2, tw, ids, **kwargs).sum().backward()
    for grad in (w1.grad, w2.grad, kwargs["w1_bias"].grad, kwargs["w2_bias"].grad):
        assert (grad[[1, 3, 4]] == 0).all() and (grad[[0, 2]] != 0).any()


def test_kernel_reads_transposed_weights_in_place_and_returns_their_layout():
    args, kwargs = problem(tokens=5, hidden=8, inter=4, experts=3, k=2)
    x, w1, w2, tw, ids = args
    out = fe.kernel(x, w1, w2, tw, ids)
    out.sum().backward()
    # The gradient of a transposed view is laid out like it, so the storage's gradient is contiguous.
    assert w1.grad.stride() == w1.stride() and w2.grad.stride() == w2.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weights_read_in_place_or_packed_in_either_layout_give_the_same_bits(dtype):
    """pack_b_min_rows picks per task between multiplying the weights in place and packing them.
    Packed weights of either layout, and contiguous rows read in place, sum in block_k's order, so
    they keep their bits. Weights whose columns are contiguous (Hugging Face's transposed views;
    in the backward, the transpose of contiguous weights) read in place by a task of at most 8 rows
    take the GEMM core's column-dot form (one dot product per result, nothing packed: 2x faster at
    decode), which sums in another order: those match, within the tolerance, not bit for bit.
    (bf16 is left out: its few-row tasks leave the dot engine for fp32 widening, by design.)"""
    # 8 experts with 1 to ~30 rows each, H = 300 past one 256-deep slice.
    args, kwargs = problem(tokens=60, hidden=300, inter=40, experts=8, k=2, dtype=dtype, grad=False)
    x, w1, w2, tw, ids = args
    ids = torch.tensor([[t % 8, (t * t + 1) % 7] for t in range(60)])
    ids[ids[:, 0] == ids[:, 1], 1] = 7
    results = {}
    for layout, (a, b) in {"views": (w1, w2), "contiguous": (w1.contiguous(), w2.contiguous())}.items():
        for min_rows in (0, 12, 1 << 30):
            config = fe.Config(task_rows=36, block_k=256, block_n=64, pack_b_min_rows=min_rows)
            leaves = [t.detach().clone().requires_grad_(True) for t in (x, a, b, tw)]
            out = fe.kernel(leaves[0], leaves[1], leaves[2], leaves[3], ids, configs=(config, config))
            out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype))
            results[layout, min_rows] = [out.detach()] + [t.grad for t in leaves]
    first = results["views", 0]  # every task packed
    want = oracle(x, w1, w2, tw, ids)
    for key, tensors in results.items():
        torch.testing.assert_close(tensors[0].double(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        for got, want_grad in zip(tensors[1:], first[1:]):
            torch.testing.assert_close(got, want_grad, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    names = ("out", "dx", "dw1", "dw2", "dtopk_weights")
    for name, got, want_bits in zip(names, results["contiguous", 0], first):
        assert torch.equal(got, want_bits), f"packed: {name} depends on the weights' layout"
    for min_rows in (12, 1 << 30):  # contiguous weights' rows read in place: block_k's order
        assert torch.equal(results["contiguous", min_rows][0], first[0]), f"contiguous, {min_rows}: out differs"
    # Decode-sized tasks (3 tokens: at most 3 rows an expert) on views read in place take the
    # column-dot form: another order of sums than packing, the same values.
    (x, w1, w2, tw, ids), _ = problem(tokens=3, hidden=300, inter=40, experts=8, k=2, dtype=dtype, grad=False)
    outs = [fe.kernel(x, w1, w2, tw, ids, configs=(fe.Config(task_rows=36, block_k=256, block_n=64,
                                                             pack_b_min_rows=min_rows), None))
            for min_rows in (0, 1 << 30)]
    torch.testing.assert_close(outs[1], outs[0], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    if dtype == torch.float32:  # fp16's rounding of so few outputs may hide the last bits
        assert not torch.equal(outs[1], outs[0])


def test_duplicate_ids_in_a_row_add_up():
    args, _ = problem(tokens=3, hidden=8, inter=4, experts=3, k=2, grad=False)
    x, w1, w2, tw, ids = args
    ids = torch.tensor([[1, 1], [0, 2], [2, 2]])
    torch.testing.assert_close(fe.kernel(x, w1, w2, tw, ids).double(), oracle(x, w1, w2, tw, ids),
                               rtol=1e-5, atol=1e-5)


def test_empty_tokens():
    args, _ = problem(tokens=0, hidden=8, inter=4, experts=3, k=2)
    out = fe.kernel(*args)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert (args[1].grad == 0).all()


# ---- the contract ----------------------------------------------------------------------------

class TokamaxOpsSeen(TorchDispatchMode):
    """Records the tokamax ops a call dispatches below autograd."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("tokamax."):
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def check_pre_activations_saved_only_with_grad(call, family, grad_enabled):
    """Under no_grad (generation) the parameters still require grad, but no backward can follow:
    the plain forward runs, not the training one that also writes the [T*k, 2I] pre-activations."""
    with TokamaxOpsSeen() as ops, torch.set_grad_enabled(grad_enabled):
        out = call()
    assert ops.names == ([f"tokamax._{family}_train.default"] if grad_enabled else [f"tokamax.{family}.default"])
    assert out.requires_grad == grad_enabled


@pytest.mark.parametrize("grad_enabled", [False, True])
def test_only_a_call_that_can_be_differentiated_saves_pre_activations(grad_enabled):
    args, kwargs = problem()
    check_pre_activations_saved_only_with_grad(lambda: fe.kernel(*args, **kwargs), "fused_experts", grad_enabled)


def _sample(**kwargs):
    return lambda: problem(**kwargs)


def _bad_inputs():
    (x, w1, w2, tw, ids), _ = problem(tokens=3, hidden=8, inter=4, experts=4, k=2, grad=False)
    ok = (x, w1, w2, tw, ids)
    return [
        BadInput(r"fused_experts: x must be 2-D \[T, H\], got shape \[24\]", (x.view(-1), w1, w2, tw, ids)),
        BadInput("fused_experts: x must be float32, bfloat16, float16 or float64, got Int",
                 (x.int(), w1, w2, tw, ids)),
        BadInput(r"fused_experts: w1 must be 3-D \[E, H, 2I\], got shape \[4, 64\]",
                 (x, w1.reshape(4, 64), w2, tw, ids)),
        BadInput("fused_experts: w1 must have x's dtype Float, got BFloat16", (x, w1.bfloat16(), w2, tw, ids)),
        BadInput(r"fused_experts: w1 must be \[E, H, 2I\] with H = x.size\(1\) = 8, got shape \[4, 7, 8\]",
                 (x, w1[:, :7], w2, tw, ids)),
        BadInput(r"fused_experts: w2 must be \[E, I, H\] = \[4, I, 8\], got shape \[3, 4, 8\]",
                 (x, w1, w2[:3], tw, ids)),
        BadInput(r"fused_experts: w1 must be \[E, H, 2I\] with 2I = 2 \* w2.size\(1\) = 6, got shape \[4, 8, 8\]",
                 (x, w1, w2[:, :3], tw, ids)),
        BadInput("fused_experts: topk_ids must be int32 or int64, got Float", (x, w1, w2, tw, ids.float())),
        BadInput(r"fused_experts: topk_ids must be \[T, k\] with T = x.size\(0\) = 3, got shape \[2, 2\]",
                 (x, w1, w2, tw[:2], ids[:2])),
        BadInput(r"fused_experts: topk_weights must have topk_ids' shape \[3, 2\], got shape \[3, 1\]",
                 (x, w1, w2, tw[:, :1], ids)),
        BadInput(r"fused_experts: act_fn must be \"silu\" or \"gelu\" \(tanh approximation\), got \"relu\"", ok,
                 {"act_fn": "relu"}),
        BadInput(r"fused_experts: w1_bias must be \[4, 8\], got shape \[4, 7\]", ok,
                 {"w1_bias": torch.zeros(4, 7)}),
        BadInput(r"fused_experts: w2_bias must be a 2-D Float tensor", ok, {"w2_bias": torch.zeros(4, 8).double()}),
        BadInput(r"fused_experts: topk_ids\[1, 1\] must be in \[0, num_experts=4\), got 4",
                 (x, w1, w2, tw, torch.tensor([[0, 1], [2, 4], [1, 3]])), kernel_only=True),
        BadInput(r"fused_experts: topk_ids\[0, 0\] must be in \[0, num_experts=4\), got -1",
                 (x, w1, w2, tw, torch.tensor([[-1, 1], [2, 3], [1, 3]], dtype=torch.int32)), kernel_only=True),
    ]


CONTRACT = OpContract(
    name="fused_experts",
    reference=fe.reference,
    kernel=fe.kernel,
    samples=[
        Sample("fp32-hf-views", _sample()),
        Sample("bf16-bias-gelu-int32", _sample(dtype=torch.bfloat16, bias=True, act_fn="gelu", id_dtype=torch.int32),
               compile=False),
        Sample("fp16-contiguous-k1", _sample(dtype=torch.float16, transposed=False, k=1, weight_dtype=torch.float16),
               compile=False),
    ],
    bad_inputs=_bad_inputs,
    invalid_configs=[
        ("expected 4 values", ([96], None)),
        ("config: fused_experts config: task_rows must be", ([0, 256, 512, 96], None)),
        ("bwd_config: fused_experts config: block_k", (None, [96, 0, 512, 96])),
    ],
    # K = H and I past several slices of every block_k in the space: the configs change the bits.
    config_samples={"forward": Sample("deep", _sample(tokens=20, hidden=600, inter=300, experts=3)),
                    "backward": Sample("deep", _sample(tokens=20, hidden=600, inter=300, experts=3))},
    # T symbolic; its sizes differ from H=24, 2I=40, E=4 and k=2.
    dynamic=[DynamicSizes("tokens", lambda t: problem(tokens=t),
                          [{"t": 5}, {"t": 9}, {"t": 17}], {"t": (2, 4096)},
                          lambda dims: ({0: dims["t"]}, None, None, {0: dims["t"]}, {0: dims["t"]}))],
    determinism_samples=[Sample("many-tokens", _sample(tokens=400, hidden=300, inter=64, experts=6, k=2)),
                         Sample("bf16-bias", _sample(tokens=300, hidden=64, inter=140, experts=8, k=3,
                                                     dtype=torch.bfloat16, bias=True))],
)


# ---- property test -----------------------------------------------------------------------------

@st.composite
def fused_experts_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    tokens, hidden = draw(st.integers(0, 20), label="T"), draw(st.integers(1, 70), label="H")
    inter, experts = draw(st.integers(1, 40), label="I"), draw(st.integers(1, 6), label="E")
    k = draw(st.integers(1, experts), label="k")
    x = layout(draw, (tokens, hidden), generator, dtype, "x")
    w1, w2, b1, b2 = weights(experts, hidden, inter, dtype, generator, draw(st.booleans(), label="hf views"),
                             draw(st.booleans(), label="bias"))
    tw, ids = routing(tokens, experts, k, generator, draw(st.sampled_from(DTYPES)),
                      draw(st.sampled_from([torch.int32, torch.int64])))
    return x, w1, w2, tw, ids, draw(st.sampled_from(["silu", "gelu"])), b1, b2


@settings(PROFILE, max_examples=60)
@given(problem=fused_experts_problems())
def fused_experts_kernel_matches_float64_oracle(problem):
    x, w1, w2, tw, ids, act_fn, b1, b2 = problem
    out = fe.kernel(x, w1, w2, tw, ids, act_fn=act_fn, w1_bias=b1, w2_bias=b2)
    tol = TOLERANCE[x.dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), oracle(x, w1, w2, tw, ids, act_fn, b1, b2), rtol=tol, atol=tol)


PROPERTIES = [fused_experts_kernel_matches_float64_oracle]
