"""linear_softmax_cross_entropy_loss: contract samples, float64-oracle numerics (loss, lse and both
gradients) for every dtype and option, F.cross_entropy's semantics, ignored rows, the nn.Linear
layout, and the property test."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import DTYPES, PROFILE, layout
import tokamax_torch
from tokamax_torch.ops import linear_softmax_cross_entropy_loss as lce

# Relative to the oracle's magnitude: loss and lse are fp32 sums of fp32-accumulated logits; bf16
# rounds the dlogits tile to bf16 (the bf16 engine's input) and the gradients to bf16; fp16 rounds
# the gradients to fp16.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5, torch.float64: 1e-12}
GRAD_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float64: 1e-10}
OPTIONS = [
    {},
    {"reduction": "mean"},
    {"reduction": "none"},
    {"label_smoothing": 0.1},
    {"z_loss_weight": 1e-2, "reduction": "mean"},
    {"logits_soft_cap": 2.0, "reduction": "none"},
    {"label_smoothing": 0.2, "z_loss_weight": 1e-3, "logits_soft_cap": 5.0, "ignore_index": 7},
]


def oracle(x, labels, w, *, reduction="sum", ignore_index=-100, label_smoothing=None, z_loss_weight=None,
           logits_soft_cap=None):
    """(loss, lse) in float64, differentiable in x and w."""
    logits = x.double() @ w.double()
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    lse = torch.logsumexp(logits, -1)
    logp = logits - lse[:, None]
    valid = labels != ignore_index
    loss = -logp.gather(1, torch.where(valid, labels, 0).long()[:, None]).squeeze(1)
    eps = label_smoothing or 0.0
    loss = (1 - eps) * loss - eps * logp.mean(-1) + (z_loss_weight or 0.0) * lse**2
    loss = torch.where(valid, loss, 0.0)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / valid.sum().clamp_min(1)
    return loss, lse


def _problem(batch, hidden, vocab, dtype, *, linear_layout=False, seed=0, ignore=(3,), ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, hidden, generator=g)).to(dtype)
    if linear_layout:  # an nn.Linear weight [V, H], passed as its transposed view
        w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype).t()
    else:
        w = (torch.randn(hidden, vocab, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, vocab, (batch,), generator=g)
    for r in ignore:
        if r < batch:
            labels[r] = ignore_index
    return x, labels, w


def _close(got, want, tol, what):
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def _check_against_oracle(impl, x, labels, w, options, *, grads=True):
    xg, wg = x.clone().requires_grad_(grads), w.detach().clone().requires_grad_(grads)
    if w.stride(0) == 1:  # keep the transposed layout of an nn.Linear weight
        wg = w.t().detach().clone().t().requires_grad_(grads)
    loss, lse = impl(xg, labels, wg, return_residuals=True, **options)
    xo, wo = x.double().requires_grad_(True), w.double().requires_grad_(True)
    want_loss, want_lse = oracle(xo, labels, wo, **options)
    assert loss.dtype == lse.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    assert loss.shape == want_loss.shape and lse.shape == (x.shape[0],)
    tol = TOLERANCE[x.dtype]
    _close(loss, want_loss, tol, "loss")
    _close(lse, want_lse, tol, "lse")
    if not grads:
        return
    upstream = torch.linspace(-1, 1, loss.numel(), dtype=torch.float64).view(loss.shape) + 0.5  # non-uniform
    lse_up = torch.linspace(0.2, -0.3, lse.numel(), dtype=torch.float64)
    ((loss.double() * upstream).sum() + (lse.double() * lse_up).sum()).backward()
    ((want_loss * upstream).sum() + (want_lse * lse_up).sum()).backward()
    assert xg.grad.dtype == x.dtype and wg.grad.dtype == w.dtype and wg.grad.stride() == wg.stride()
    _close(xg.grad, xo.grad, GRAD_TOLERANCE[x.dtype], "dx")
    _close(wg.grad, wo.grad, GRAD_TOLERANCE[x.dtype], "dweights")


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("impl", [lce.reference, lce.kernel])
def test_matches_float64_oracle(impl, dtype, options):
    x, labels, w = _problem(37, 50, 301, dtype, ignore_index=options.get("ignore_index", -100))
    _check_against_oracle(impl, x, labels, w, options)


@pytest.mark.parametrize("impl,num_threads", [(lce.kernel, n) for n in THREAD_COUNTS], indirect=["num_threads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_tiles_and_row_blocks(impl, num_threads, dtype):
    """Several vocab tiles (with a partial last one), row blocks and H chunks, nn.Linear layout."""
    x, labels, w = _problem(150, 200, 1100, dtype, linear_layout=True, ignore=(0, 77))
    config = lce.Config(row_block=32, vocab_block=256, block_k=64)
    _check_against_oracle(lambda *a, **k: impl(*a, configs=(config, config), **k), x, labels, w,
                          {"label_smoothing": 0.1, "reduction": "mean"})


def test_semantics_of_f_cross_entropy():
    """sum / mean / none, ignore_index and label_smoothing as F.linear + F.cross_entropy (float64)."""
    x, labels, w = _problem(40, 16, 90, torch.float64, ignore=(1, 5, 6))
    for reduction in ("sum", "mean", "none"):
        for smoothing in (0.0, 0.3):
            want = F.cross_entropy(F.linear(x, w.t()), labels, reduction=reduction, label_smoothing=smoothing)
            got = lce.kernel(x, labels, w, reduction=reduction, label_smoothing=smoothing)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("impl", [lce.reference, lce.kernel])
def test_all_ignored_gives_zero_loss_and_gradients(impl, reduction):
    x, labels, w = _problem(9, 12, 40, torch.float32)
    labels[:] = -100
    xg, wg = x.requires_grad_(True), w.requires_grad_(True)
    loss = impl(xg, labels, wg, reduction=reduction, label_smoothing=0.1, z_loss_weight=0.1)
    assert not loss.isnan().any() and (loss == 0).all()
    loss.sum().backward()
    assert (xg.grad == 0).all() and (wg.grad == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_z_loss_off_is_bitwise_the_plain_loss(dtype):
    x, labels, w = _problem(33, 20, 70, dtype)
    results = []
    for z in (None, 0.0, 0.5):
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss, lse = lce.kernel(xg, labels, wg, z_loss_weight=z, reduction="none", return_residuals=True)
        loss.sum().backward()
        results.append((loss, lse, xg.grad, wg.grad))
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)
    valid = labels != -100
    torch.testing.assert_close(results[2][0][valid], (results[0][0] + 0.5 * results[0][1] ** 2)[valid])


def test_weights_view_of_nn_linear_is_not_copied_and_gets_its_layout():
    head = torch.nn.Linear(24, 50, bias=False)
    x = torch.randn(10, 24, requires_grad=True)
    labels = torch.randint(0, 50, (10,))
    lce.kernel(x, labels, head.weight.t()).backward()
    assert head.weight.grad.is_contiguous() and head.weight.grad.shape == (50, 24)
    want = torch.autograd.grad(F.cross_entropy(F.linear(x, head.weight), labels, reduction="sum"), head.weight)[0]
    torch.testing.assert_close(head.weight.grad, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("label", [-1, 40, 10**6])
def test_labels_out_of_range_raise_before_compute(label):
    x, labels, w = _problem(6, 8, 40, torch.float32)
    labels[2] = label
    with pytest.raises(RuntimeError, match=rf"labels must be in \[0, 40\) .* or ignore_index \(-100\), got {label} "
                                           r"at row 2"):
        lce.kernel(x, labels, w)


@pytest.mark.parametrize("num_threads", [1], indirect=True)
@pytest.mark.parametrize("options", [{}, {"reduction": "none", "label_smoothing": 0.2, "z_loss_weight": 0.1,
                                          "logits_soft_cap": 1.5}])
def test_gradcheck_float64(num_threads, options):
    x, labels, w = _problem(5, 4, 7, torch.float64, ignore=(2,))
    x.requires_grad_(True)
    w.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: lce.kernel(a, labels, b, **options), (x, w))


def test_int32_labels_and_empty_batch():
    x, labels, w = _problem(7, 9, 30, torch.float32)
    torch.testing.assert_close(lce.kernel(x, labels.int(), w), lce.kernel(x, labels, w), rtol=0, atol=0)
    empty = torch.empty(0, 9, requires_grad=True)
    wg = w.clone().requires_grad_(True)
    loss = lce.kernel(empty, torch.empty(0, dtype=torch.long), wg, reduction="mean")
    assert loss.item() == 0.0
    loss.backward()
    assert (wg.grad == 0).all() and empty.grad.shape == (0, 9)


def _rss_growth_mib(fn) -> float:
    """Growth of the resident set's high-water mark during fn() (Linux clear_refs)."""
    def status_kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return 0
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("no /proc/self/clear_refs to reset the RSS high-water mark")
    before = status_kib("VmRSS")
    fn()
    return (status_kib("VmHWM") - before) / 1024


def test_forward_backward_never_holds_the_logits():
    """B x V fp32 logits are 64 MiB here; the call's only large allocation is dweights (16 MiB)."""
    b, h, v = 256, 64, 65536
    x = torch.randn(b, h, requires_grad=True)
    head = torch.randn(v, h).mul_(0.1).requires_grad_(True)
    labels = torch.randint(0, v, (b,))
    tokamax_torch.empty_cache()
    growth = _rss_growth_mib(lambda: lce.kernel(x, labels, head.t()).backward())
    assert growth < 40, f"resident set grew {growth:.0f} MiB; the logits alone are {b * v * 4 / 2**20:.0f} MiB"


# ---- the forward with the gradient folded in (sum / mean, a gradient needed) ----------------------

FOLD_OPTIONS = [
    {},
    {"reduction": "mean"},
    {"label_smoothing": 0.1, "reduction": "mean"},
    {"z_loss_weight": 1e-2},
    {"logits_soft_cap": 2.0},
    {"label_smoothing": 0.2, "z_loss_weight": 1e-3, "logits_soft_cap": 5.0, "ignore_index": 7, "reduction": "mean"},
]


def _op_names(fn) -> set:
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.function_events}


def _folded_forward_backward(x, labels, w, upstream, **options):
    xg = x.clone().requires_grad_(True)
    wg = (w.t().detach().clone().t() if w.stride(0) == 1 else w.detach().clone()).requires_grad_(True)
    loss = lce.kernel(xg, labels, wg, **options)
    (loss * upstream).backward()
    return loss, xg.grad, wg.grad


@pytest.mark.parametrize("options", FOLD_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("dtype", TOLERANCE)
def test_folded_gradients_match_float64_oracle(dtype, options):
    """A scalar loss with a gradient needed runs the `_train` forward (3 products) and a backward
    that only scales its gradients by the upstream gradient (here -1.7, not 1); bf16/fp16 on the
    amx tier run the unfolded backward. Either way the gradients match the oracle."""
    x, labels, w = _problem(37, 50, 301, dtype, linear_layout=True, ignore_index=options.get("ignore_index", -100))
    upstream = -1.7
    names = _op_names(lambda: _folded_forward_backward(x, labels, w, upstream, **options))
    # bf16/fp16 fold everywhere but on the amx tier (LinearCrossEntropyFolds).
    folds = dtype in (torch.float32, torch.float64) or not tokamax_torch.device_kind().endswith("_amx")
    assert ("tokamax::_linear_softmax_cross_entropy_loss_train" in names) == folds
    assert ("tokamax::_linear_softmax_cross_entropy_loss_backward" in names) == (not folds)
    loss, dx, dw = _folded_forward_backward(x, labels, w, upstream, **options)
    xo, wo = x.double().requires_grad_(True), w.double().requires_grad_(True)
    want_loss, _ = oracle(xo, labels, wo, **options)
    (want_loss * upstream).backward()
    _close(loss, want_loss, TOLERANCE[dtype], "loss")
    assert dx.dtype == dtype and dw.dtype == dtype and dw.stride() == w.stride()
    _close(dx, xo.grad, GRAD_TOLERANCE[dtype], "dx")
    _close(dw, wo.grad, GRAD_TOLERANCE[dtype], "dweights")


@pytest.mark.parametrize("linear_layout", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_forward_is_bitwise_the_plain_forward_and_thread_count_free(dtype, linear_layout):
    """Several row blocks, vocab tiles and H chunks: loss and lse bitwise the no-grad forward's;
    dx and dweights bitwise the same at 1, 2 and 3 threads and against the unfolded backward
    within the gradient tolerance (upstream 1: the scale is the identity)."""
    x, labels, w = _problem(150, 600, 1100, dtype, linear_layout=linear_layout, ignore=(0, 77))
    config = lce.Config(row_block=32, vocab_block=256, block_k=64)
    options = dict(label_smoothing=0.1, reduction="mean", configs=(config, config))
    with torch.no_grad():
        plain_loss, plain_lse = lce.kernel(x, labels, w, return_residuals=True, **options)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            xg, wg = x.clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
            loss, lse = lce.kernel(xg, labels, wg, return_residuals=True, **options)
            loss.backward()
            results.append((loss, lse, xg.grad, wg.grad))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], plain_loss) and torch.equal(results[0][1], plain_lse)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    # The unfolded backward (an lse cotangent of zeros forces it) agrees.
    xg, wg = x.clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    loss, lse = lce.kernel(xg, labels, wg, return_residuals=True, **options)
    (loss + 0 * lse.sum()).backward()
    _close(xg.grad, results[0][2], GRAD_TOLERANCE[dtype], "dx")
    _close(wg.grad, results[0][3], GRAD_TOLERANCE[dtype], "dweights")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_train_op_gradients_for_half_dtypes(dtype):
    """The `_train` op (autograd's choice for bf16/fp16 except on amx) gives the gradients for dloss = 1."""
    x, labels, w = _problem(37, 50, 301, dtype, linear_layout=True)
    loss, _, dx, dw = torch.ops.tokamax._linear_softmax_cross_entropy_loss_train(
        x, labels, w, "sum", -100, None, None, None, True, True, None, None)
    xo, wo = x.double().requires_grad_(True), w.double().requires_grad_(True)
    want_loss, _ = oracle(xo, labels, wo)
    want_loss.backward()
    _close(loss, want_loss, TOLERANCE[dtype], "loss")
    _close(dx, xo.grad, GRAD_TOLERANCE[dtype], "dx")
    _close(dw, wo.grad, GRAD_TOLERANCE[dtype], "dweights")


def test_inference_and_none_do_not_fold():
    x, labels, w = _problem(20, 16, 60, torch.float32)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with torch.no_grad():
        assert "tokamax::_linear_softmax_cross_entropy_loss_train" not in _op_names(lambda: lce.kernel(xg, labels, wg))
    names = _op_names(lambda: lce.kernel(xg, labels, wg, reduction="none").sum().backward())
    assert "tokamax::_linear_softmax_cross_entropy_loss_train" not in names
    assert "tokamax::_linear_softmax_cross_entropy_loss_backward" in names


def test_fold_with_one_input_needing_grad():
    x, labels, w = _problem(20, 16, 60, torch.float32)
    want_x, want_w = x.double().requires_grad_(True), w.double().requires_grad_(True)
    (oracle(want_x, labels, want_w)[0] * 0.5).backward()
    xg = x.clone().requires_grad_(True)
    (lce.kernel(xg, labels, w) * 0.5).backward()
    _close(xg.grad, want_x.grad, GRAD_TOLERANCE[torch.float32], "dx")
    wg = w.clone().requires_grad_(True)
    (lce.kernel(x, labels, wg) * 0.5).backward()
    _close(wg.grad, want_w.grad, GRAD_TOLERANCE[torch.float32], "dweights")


# ---- the shared contract --------------------------------------------------------------------------

def _sample(batch, hidden, vocab, dtype=torch.float32, linear_layout=False, **kwargs):
    def make():
        x, labels, w = _problem(batch, hidden, vocab, dtype, linear_layout=linear_layout,
                                ignore_index=kwargs.get("ignore_index", -100))
        return (x.requires_grad_(True), labels, w.requires_grad_(True)), dict(kwargs)
    return make


def _bad(x_shape=(4, 6), w_shape=(6, 5), labels=None, dtype=torch.float32, **kwargs):
    labels = torch.zeros(x_shape[0] if x_shape else 1, dtype=torch.long) if labels is None else labels
    return (torch.randn(*x_shape).to(dtype), labels, torch.randn(*w_shape)), kwargs


CONTRACT = OpContract(
    name="linear_softmax_cross_entropy_loss",
    reference=lce.reference,
    kernel=lce.kernel,
    samples=[
        Sample("fp32", _sample(6, 40, 30)),
        Sample("mean-smoothing", _sample(7, 24, 45, reduction="mean", label_smoothing=0.1)),
        Sample("none-zloss-cap", _sample(6, 24, 45, reduction="none", z_loss_weight=1e-3, logits_soft_cap=4.0)),
        Sample("nn-linear-layout", _sample(6, 40, 30, linear_layout=True, ignore_index=2)),
        Sample("bf16", _sample(6, 40, 30, torch.bfloat16), compile=False),
    ],
    bad_inputs=lambda: [
        BadInput(r"x must be 2-D \[B, H\], got shape \[4\]", *_bad(x_shape=(4,), labels=torch.zeros(4).long())),
        BadInput(r"weights must be \[H, V\] with H = 6 \(x's last dim\), got shape \[5, 5\]", *_bad(w_shape=(5, 5))),
        BadInput(r"weights must be 2-D \[H, V\], got shape \[6\]", *_bad(w_shape=(6,))),
        BadInput("weights must have x's dtype Double, got Float", *_bad(dtype=torch.float64)),
        BadInput(r"labels must have length B = 4 \(x's rows\), got shape \[3\]",
                 *_bad(labels=torch.zeros(3, dtype=torch.long))),
        BadInput("labels must be int64 or int32, got Float", *_bad(labels=torch.zeros(4))),
        BadInput("x must be float32, bfloat16, float16 or float64, got Int",
                 (torch.ones(4, 6, dtype=torch.int32), torch.zeros(4, dtype=torch.long), torch.ones(6, 5)), {}),
        BadInput("reduction must be 'sum', 'mean' or 'none', got 'avg'", *_bad(reduction="avg")),
        BadInput(r"label_smoothing must be in \[0, 1\], got 1.5", *_bad(label_smoothing=1.5)),
        BadInput("z_loss_weight must be >= 0, got -1", *_bad(z_loss_weight=-1.0)),
        BadInput("logits_soft_cap must be positive", *_bad(logits_soft_cap=0.0)),
        BadInput(r"labels must be in \[0, 5\) \(V, the vocabulary\) or ignore_index \(-100\), got 5 at row 1",
                 *_bad(labels=torch.tensor([0, 5, -100, 1])), kernel_only=True),
    ],
    invalid_configs=[
        ("expected 3 values", ([16], None)),
        ("config: linear_softmax_cross_entropy_loss config: row_block must be", ([8, 64, 64], None)),
        ("bwd_config: linear_softmax_cross_entropy_loss config: vocab_block", (None, [16, 0, 64])),
        (r"row_block \* vocab_block \* 4 must be at most 8 MiB", ([8192, 16384, 64], None)),
    ],
    config_samples={"forward": Sample("tiles", _sample(70, 32, 300)),
                    "backward": Sample("tiles", _sample(70, 32, 300))},
    dynamic=[DynamicSizes("batch", lambda b: _sample(b, 24, 40, reduction="none")(), [{"b": 5}, {"b": 9}, {"b": 17}],
                          {"b": (2, 4096)}, lambda dims: ({0: dims["b"]}, {0: dims["b"]}, None))],
    determinism_samples=[Sample("many-rows", _sample(600, 400, 2500, reduction="mean", label_smoothing=0.1)),
                         Sample("bf16-linear", _sample(300, 200, 1500, torch.bfloat16, linear_layout=True))],
)


# ---- property test --------------------------------------------------------------------------------

@st.composite
def lce_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    batch, hidden = draw(st.integers(0, 40), label="B"), draw(st.integers(0, 48), label="H")
    vocab = draw(st.integers(1, 300), label="V")
    x = layout(draw, (batch, hidden), generator, dtype, "x")
    w = layout(draw, (hidden, vocab), generator, dtype, "weights") * 0.3
    labels = torch.randint(0, vocab, (batch,), generator=generator)
    labels[torch.rand(batch, generator=generator) < 0.2] = -100
    options = dict(reduction=draw(st.sampled_from(["sum", "mean", "none"])),
                   label_smoothing=draw(st.sampled_from([None, 0.1])),
                   z_loss_weight=draw(st.sampled_from([None, 1e-2])),
                   logits_soft_cap=draw(st.sampled_from([None, 3.0])))
    return x, labels, w, options


@settings(PROFILE, max_examples=120)
@given(problem=lce_problems())
def linear_softmax_cross_entropy_loss_kernel_matches_float64_oracle(problem):
    x, labels, w, options = problem
    loss, lse = lce.kernel(x, labels, w, return_residuals=True, **options)
    want_loss, want_lse = oracle(x, labels, w, **options)
    assert not loss.isnan().any()
    _close(loss, want_loss, TOLERANCE[x.dtype] * 10, "loss")
    _close(lse, want_lse, TOLERANCE[x.dtype] * 10, "lse")


PROPERTIES = [linear_softmax_cross_entropy_loss_kernel_matches_float64_oracle]


@pytest.mark.parametrize("impl", [lce.kernel, lce.reference], ids=["kernel", "reference"])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_an_empty_vocabulary_with_every_label_ignored(impl, reduction):
    # V = 0 is valid when no label needs a class: loss 0, lse -inf, zero gradients; the reference
    # once raised ATen's gather error (an ignored row picked column 0).
    x = torch.randn(3, 4, requires_grad=True)
    weights = torch.randn(4, 0, requires_grad=True)
    loss, lse = impl(x, torch.full((3,), -100), weights, reduction=reduction, return_residuals=True)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss)) and (lse == float("-inf")).all()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("impl", [lce.kernel, lce.reference], ids=["kernel", "reference"])
def test_a_row_of_minus_inf_logits_has_minus_inf_lse_not_nan(impl):
    # Infinite inputs can make every logit of a row -inf: its lse is -inf, as logsumexp gives,
    # not NaN from exp(-inf - -inf) (the vector exp keeps NaN since the seventh session).
    x = torch.randn(3, 4)
    x[1, 0] = -math.inf
    weights = torch.randn(4, 40)
    weights[0] = weights[0].abs() + 0.5  # row 1's logits: -inf in every column
    _, lse = impl(x, torch.tensor([0, -100, 2]), weights, reduction="none", return_residuals=True)
    assert lse[1] == -math.inf and lse[[0, 2]].isfinite().all()
