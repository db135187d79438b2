"""dot_product_attention: its contract samples, its float64-oracle numerics and its special cases.

The checks every op owes (opcheck, compile, export, configs, bad inputs, determinism) run in
tests/test_op_contract.py from CONTRACT below.
"""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tokamax_torch
from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import DTYPES, PROFILE, layout
from tokamax_torch.ops import dot_product_attention as dpa

IMPLEMENTATIONS = [dpa.reference, dpa.kernel]
# max|out - oracle| / max|oracle| against float64 math on the same (rounded) inputs; bf16/fp16
# are dominated by the rounding of the output itself.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 3e-3, torch.float64: 1e-12}
GRAD_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 6e-3, torch.float64: 1e-10}


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda impl: impl.name)
def impl(request):
    return request.param


def make_qkv(b, t, s, n, k, h, hv=None, dtype=torch.float32, requires_grad=False):
    hv = h if hv is None else hv
    tensors = [torch.randn(b, t, n, h), torch.randn(b, s, k, h), torch.randn(b, s, k, hv)]
    return [x.to(dtype).requires_grad_(requires_grad) for x in tensors]


def oracle(q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, query_seq_lengths=None,
           key_value_seq_lengths=None, local_window_size=None, logits_soft_cap=None, q_segment_ids=None,
           kv_segment_ids=None):
    """float64 math with an explicit dense [B, N, T, S] visibility mask: the ground truth."""
    q, k, v = q.double(), k.double(), v.double()
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    k = k.repeat_interleave(n // kv_heads, dim=2)
    v = v.repeat_interleave(n // kv_heads, dim=2)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    logits = torch.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + bias.double()
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    visible = torch.ones(b, n, t, s, dtype=torch.bool)
    i = torch.arange(t)[:, None]
    j = torch.arange(s)[None, :]
    if is_causal:
        visible &= j <= i
    if local_window_size is not None:
        left, right = (local_window_size, local_window_size) if isinstance(local_window_size, int) else local_window_size
        if left is not None:
            visible &= j >= i - left
        if right is not None:
            visible &= j <= i + right
    for bi in range(b):
        if query_seq_lengths is not None:
            visible[bi, :, int(query_seq_lengths[bi]):, :] = False
        if key_value_seq_lengths is not None:
            visible[bi, :, :, int(key_value_seq_lengths[bi]):] = False
        if q_segment_ids is not None:
            visible[bi] &= (q_segment_ids[bi][:, None] == kv_segment_ids[bi][None, :])
    if mask is not None:
        visible &= mask
    logits = logits.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)  # -inf for rows with nothing visible
    probs = torch.exp(logits - lse[..., None].clamp_min(-1e300)).nan_to_num(0.0)
    probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)
    out = torch.einsum("bnts,bsnh->btnh", probs, v)
    return out, lse


def rel_error(got, want):
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), "non-finite entries differ"
    assert torch.equal(got[~finite], want[~finite])
    if not finite.any():
        return 0.0
    return ((got - want)[finite].abs().max() / want[finite].abs().max().clamp_min(1e-6)).item()


def assert_matches_oracle(impl, args, kwargs, dtype):
    out, lse = impl(*args, return_residuals=True, **kwargs)
    want_out, want_lse = oracle(*args, **kwargs)
    assert out.dtype == args[0].dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert rel_error(out, want_out) <= TOLERANCE[dtype]
    assert rel_error(lse, want_lse) <= max(TOLERANCE[torch.float32], TOLERANCE[dtype] if dtype == torch.float64 else 0)
    return out, lse


def segment_ids(b, length, segments):
    return (torch.arange(length) * segments // max(length, 1)).to(torch.int32).repeat(b, 1)


# Every option alone, then all together (on a GQA problem with T != S).
OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "window": {"local_window_size": (5, 2)},
    "window_int": {"local_window_size": 3},
    "window_left_only": {"local_window_size": (4, None)},
    "lengths": {"query_seq_lengths": torch.tensor([19, 7]), "key_value_seq_lengths": torch.tensor([0, 25])},
    "segments": {"q_segment_ids": segment_ids(2, 19, 3), "kv_segment_ids": segment_ids(2, 29, 3)},
    "softcap": {"logits_soft_cap": 0.7},
    "scale": {"scale": 0.5},
    "bias": {"bias": torch.randn(1, 6, 19, 29)},
    "mask": {"mask": torch.rand(2, 1, 19, 29) > 0.3},
    "all": {
        "is_causal": True, "local_window_size": (12, 0), "query_seq_lengths": torch.tensor([17, 19]),
        "key_value_seq_lengths": torch.tensor([29, 11]), "q_segment_ids": segment_ids(2, 19, 2),
        "kv_segment_ids": segment_ids(2, 29, 2), "logits_soft_cap": 2.0, "bias": torch.randn(6, 19, 29),
        "mask": torch.rand(19, 29) > 0.2,
    },
}


def _split(kwargs):
    kwargs = dict(kwargs)
    return kwargs.pop("bias", None), kwargs.pop("mask", None), kwargs


@pytest.mark.parametrize("option", OPTIONS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl,num_threads", [(dpa.reference, None)] + [(dpa.kernel, n) for n in THREAD_COUNTS],
                         ids=["reference"] + [f"kernel-{n}threads" for n in THREAD_COUNTS], indirect=["num_threads"])
def test_matches_float64_oracle(impl, num_threads, option, dtype):
    q, k, v = make_qkv(2, 19, 29, 6, 2, 16, 24, dtype)
    bias, mask, kwargs = _split(OPTIONS[option])
    bias = None if bias is None else bias.to(dtype)
    assert_matches_oracle(impl, (q, k, v, bias, mask), kwargs, dtype)


_PAIRABLE = ["causal", "window", "lengths", "segments", "softcap", "scale", "bias", "mask"]


@pytest.mark.parametrize("first,second", [(a, b) for i, a in enumerate(_PAIRABLE) for b in _PAIRABLE[i + 1:]])
def test_every_pair_of_options_matches_float64_oracle(impl, first, second):
    bias, mask, kwargs = _split({**OPTIONS[first], **OPTIONS[second]})
    assert_matches_oracle(impl, (*make_qkv(2, 19, 29, 6, 2, 16), bias, mask), kwargs, torch.float32)


@pytest.mark.parametrize("b,t,s,n,k,h,hv", [
    (1, 1, 300, 8, 2, 64, 64),    # decode: one query, split kv
    (2, 70, 20, 4, 4, 8, 3),      # T > S
    (1, 20, 70, 3, 1, 7, 9),      # T < S, MQA, odd head dims
    (3, 1, 1, 2, 1, 4, 4),
    (1, 130, 130, 2, 2, 256, 128),  # the largest head dim
])
@pytest.mark.parametrize("is_causal", [False, True])
def test_shapes(impl, b, t, s, n, k, h, hv, is_causal):
    q, k_, v = make_qkv(b, t, s, n, k, h, hv)
    assert_matches_oracle(impl, (q, k_, v), {"is_causal": is_causal}, torch.float32)


@pytest.mark.parametrize("option", ["plain", "causal", "softcap", "bias", "all"])
@pytest.mark.parametrize("t,hv", [(1, 96), (2, 32)])
def test_bf16_decode_row_products_match_float64(option, t, hv):
    # Few query rows take the row path; bf16 with head dims of whole 32-element steps takes the
    # bf16 row products where the tier has them (avx512bf16: vdpbf16ps, P rounded to bf16),
    # else the widening ones. Both against the oracle, on every tier the CPU supports (the kernel:
    # the reference ignores the tier).
    impl = dpa.kernel
    q, k, v = make_qkv(2, t, 29, 8, 2, 64, hv, torch.bfloat16)
    bias = torch.randn(2, 8, t, 29).bfloat16() if option in ("bias", "all") else None
    mask = torch.rand(2, 1, t, 29) > 0.3 if option == "all" else None
    kwargs = {"plain": {}, "causal": {"is_causal": True}, "softcap": {"logits_soft_cap": 2.0}, "bias": {},
              "all": {"local_window_size": (20, 0), "logits_soft_cap": 2.0, "key_value_seq_lengths": torch.tensor([29, 11]),
                      "q_segment_ids": torch.zeros(2, t, dtype=torch.int32),
                      "kv_segment_ids": segment_ids(2, 29, 2)}}[option]
    for isa in ("avx512", "avx512bf16"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TOKAMAX_CPU_ISA", isa)
            try:
                out, lse = assert_matches_oracle(impl, (q, k, v, bias, mask), kwargs, torch.bfloat16)
            except RuntimeError as e:
                assert "not supported" in str(e)
                continue
            # The same bits again, and on one thread (the splits depend on the config only).
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1)
                again, lse_again = impl(q, k, v, bias, mask, return_residuals=True, **kwargs)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(out, again) and torch.equal(lse, lse_again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", ["plain", "lengths", "all"])
def test_decode_from_a_head_major_cache(impl, dtype, option):
    # The usual KV-cache layout, [B, K, S, H] storage passed as a transposed view: the row path
    # walks each head's keys in turn (its memory order) and gives the same bits as [B, S, K, H].
    bias, mask, kwargs = _split(OPTIONS[option])
    s = 300  # past one kv tile, with a partial last run
    q = torch.randn(2, 1, 6, 64).to(dtype)
    k, v = (torch.randn(2, 2, s, 64).to(dtype) for _ in range(2))
    kwargs = {key: value for key, value in kwargs.items() if key not in ("q_segment_ids", "kv_segment_ids")}
    if "query_seq_lengths" in kwargs:
        kwargs.update(query_seq_lengths=torch.tensor([1, 1]), key_value_seq_lengths=torch.tensor([0, 293]))
    bias = None if bias is None else torch.randn(6, 1, s)
    mask = None if mask is None else torch.rand(1, s) > 0.2
    # Under top-left alignment the one query is at position 0: causal or a left window would
    # leave it key 0 alone.
    kwargs.pop("is_causal", None)
    kwargs.pop("local_window_size", None)
    strided = impl(q, k.transpose(1, 2), v.transpose(1, 2), bias, mask, **kwargs)
    contiguous = impl(q, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), bias, mask, **kwargs)
    assert torch.equal(strided, contiguous)
    want, _ = oracle(q, k.transpose(1, 2), v.transpose(1, 2), bias, mask, **kwargs)
    assert rel_error(strided, want) <= TOLERANCE[dtype]


def test_matches_sdpa(impl):
    q, k, v = make_qkv(2, 33, 33, 8, 2, 32)
    got = impl(q, k, v, is_causal=True)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    mask = torch.rand(33, 33) > 0.5
    mask[:, 0] = True  # SDPA gives NaN for fully masked rows; ours gives 0
    got = impl(q, k, v, mask=mask)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    # T != S both ways, causal (SDPA's is_causal is top-left aligned too), an explicit scale and a
    # float mask as bias; forward and the three gradients.
    for t, s in ((17, 40), (40, 17)):
        q, k, v = make_qkv(2, t, s, 8, 2, 32, requires_grad=True)
        bias = torch.randn(1, 8, t, s)
        got = impl(q, k, v, bias, is_causal=True, scale=0.3)
        sdpa_inputs = [x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v)]
        visible = torch.ones(t, s, dtype=torch.bool).tril()
        want = F.scaled_dot_product_attention(*sdpa_inputs, attn_mask=bias.masked_fill(~visible, -math.inf),
                                              scale=0.3, enable_gqa=True)
        torch.testing.assert_close(got, want.transpose(1, 2), rtol=2e-5, atol=2e-5)
        dout = torch.randn_like(got)
        got.backward(dout)
        want.backward(dout.transpose(1, 2))
        for x, y in zip((q, k, v), sdpa_inputs):
            torch.testing.assert_close(x.grad, y.grad.transpose(1, 2), rtol=1e-4, atol=1e-4)


def test_every_isa_tier(monkeypatch):
    impl = dpa.kernel
    q, k, v = make_qkv(1, 40, 50, 4, 2, 24)
    # Head dims that fit bf16 tiles (H % 32, Hv % 16): the bf16 product engine of the avx512bf16
    # (vdpbf16ps) and amx (tile unit) tiers.
    tile_q, tile_k, tile_v = make_qkv(1, 40, 50, 4, 2, 64, dtype=torch.bfloat16)
    for isa in ("scalar", "avx2", "avx512", "avx512bf16", "amx"):
        monkeypatch.setenv("TOKAMAX_CPU_ISA", isa)
        try:
            assert_matches_oracle(impl, (q, k, v), {"is_causal": True, "logits_soft_cap": 1.5}, torch.float32)
        except RuntimeError as e:
            assert "not supported" in str(e)  # a tier this CPU lacks is a clear error, not a crash
            continue
        assert_matches_oracle(impl, (tile_q, tile_k, tile_v), {"is_causal": True, "local_window_size": (9, 2)},
                              torch.bfloat16)


def test_zero_length_sequences(impl):
    q, k, v = make_qkv(2, 0, 5, 2, 1, 8)
    out, lse = impl(q, k, v, return_residuals=True)
    assert out.shape == (2, 0, 2, 8) and lse.shape == (2, 2, 0)
    q, k, v = make_qkv(2, 4, 0, 2, 1, 8, requires_grad=True)
    out, lse = impl(q, k, v, return_residuals=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    (out.sum() + lse.exp().sum()).backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    assert k.grad.shape == k.shape and v.grad.shape == v.shape
    # T = 0 backward: no query, so zero key and value gradients.
    q, k, v = make_qkv(2, 0, 5, 2, 1, 8, requires_grad=True)
    impl(q, k, v).sum().backward()
    assert q.grad.shape == q.shape and torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))
    # B = 0.
    q, k, v = make_qkv(0, 4, 5, 2, 1, 8, requires_grad=True)
    out = impl(q, k, v, is_causal=True)
    assert out.shape == (0, 4, 2, 8)
    out.sum().backward()
    assert k.grad.shape == k.shape
    # A query length of 0: that batch's rows see nothing (zeros, zero gradients), the other's as usual.
    q, k, v = make_qkv(2, 4, 5, 2, 1, 8, requires_grad=True)
    lengths = torch.tensor([0, 4])
    out = impl(q, k, v, query_seq_lengths=lengths)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    (out * torch.randn_like(out)).sum().backward()
    assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0])) and torch.equal(k.grad[0], torch.zeros_like(k.grad[0]))
    want, _ = oracle(q.detach(), k.detach(), v.detach(), query_seq_lengths=lengths)
    assert rel_error(out.detach(), want) <= TOLERANCE[torch.float32]


def test_fully_masked_rows_are_zero_with_zero_gradients(impl):
    q, k, v = make_qkv(2, 12, 12, 2, 1, 16, requires_grad=True)
    bias = torch.randn(2, 2, 12, 12, requires_grad=True)
    kwargs = dict(query_seq_lengths=torch.tensor([5, 12]), key_value_seq_lengths=torch.tensor([12, 0]),
                  local_window_size=(2, 0))
    out, lse = impl(q, k, v, bias, return_residuals=True, **kwargs)
    assert torch.equal(out[0, 5:], torch.zeros_like(out[0, 5:])) and torch.equal(out[1], torch.zeros_like(out[1]))
    assert bool((lse[0, :, 5:] == -math.inf).all()) and bool((lse[1] == -math.inf).all())
    (out * torch.randn_like(out)).sum().backward()
    for x in (q, k, v, bias):
        assert torch.isfinite(x.grad).all()
    assert torch.equal(q.grad[0, 5:], torch.zeros_like(q.grad[0, 5:]))
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))
    assert torch.equal(k.grad[1], torch.zeros_like(k.grad[1])) and torch.equal(bias.grad[1], torch.zeros_like(bias.grad[1]))


def test_non_contiguous_inputs(impl):
    # PyTorch's [B, N, T, H] layout passed as transposed views, and a sliced value.
    qh, kh = torch.randn(2, 4, 21, 16), torch.randn(2, 2, 27, 16)
    vh = torch.randn(2, 2, 27, 40)[..., ::2]
    q, k, v = qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    bias = torch.randn(2, 21, 4, 27).transpose(1, 2)
    ids = torch.zeros(2, 2 * 21, dtype=torch.int32)[:, ::2]
    kw = dict(bias=bias, is_causal=True, q_segment_ids=ids, kv_segment_ids=torch.zeros(2, 27, dtype=torch.int32))
    out, lse = assert_matches_oracle(impl, (q, k, v), kw, torch.float32)
    torch.testing.assert_close(out, impl(q.contiguous(), k.contiguous(), v.contiguous(), **kw), rtol=0, atol=0)
    # The gradients too: read through the strides, the same bits as from contiguous copies.
    grads = []
    for make in (lambda x: x, lambda x: x.contiguous()):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        (impl(*[make(x) for x in leaves], **kw) * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reused_working_memory_gives_the_same_bits(dtype):
    # Packed K/V copies and dK/dV partial sums of this size (2-4 MiB) are mapped and, once
    # released, kept for the next call: a reused buffer holds the previous call's values, which
    # must never reach a result.
    q, k, v = make_qkv(1, 512, 512, 8, 8, 128, dtype=dtype, requires_grad=True)
    dout = torch.randn(1, 512, 8, 128, dtype=dtype)

    def forward_backward():
        out = dpa.kernel(q, k, v, is_causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    tokamax_torch.empty_cache()
    assert tokamax_torch.cached_bytes() == 0
    fresh = forward_backward()
    assert tokamax_torch.cached_bytes() > 0
    reused = forward_backward()
    other = make_qkv(1, 512, 512, 8, 8, 128, dtype=dtype)  # different values through the buffers
    dpa.kernel(*other, is_causal=True)
    again = forward_backward()
    tokamax_torch.empty_cache()
    assert tokamax_torch.cached_bytes() == 0
    for a, b, c in zip(fresh, reused, again):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_buffer_cache_limit_from_environment():
    code = ("import torch, tokamax_torch as t; q = torch.randn(1, 512, 8, 128);"
            " t.dot_product_attention(q, q, q, is_causal=True); print(t.cached_bytes())")
    env = dict(os.environ, TOKAMAX_BUFFER_CACHE_MIB="0")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(result.stdout.strip()) == 0
    env["TOKAMAX_BUFFER_CACHE_MIB"] = "64"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert 0 < int(result.stdout.strip()) <= 64 << 20


# ---- gradients ----------------------------------------------------------------------------------

def assert_gradients_match_float64_reference(q, k, v, bias, mask, kwargs, dtypes):
    """The kernel's output and gradients at each of `dtypes` against the reference's in float64:
    q, k, v (and bias, if any) are float64 leaves; the kernel sees their rounding, so the
    comparison is at that dtype's tolerances."""
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    out, lse = dpa.reference(q, k, v, bias, mask, return_residuals=True, **kwargs)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse).masked_fill(lse == -math.inf, 0)
    want = torch.autograd.grad((out, lse), inputs, (dout, dlse), allow_unused=True)
    for dtype in dtypes:
        low = [x.detach().to(dtype).requires_grad_(True) for x in inputs]
        got_out, got_lse = dpa.kernel(low[0], low[1], low[2], low[3] if bias is not None else None, mask,
                                      return_residuals=True, **kwargs)
        assert rel_error(got_out, out) <= TOLERANCE[dtype]
        got = torch.autograd.grad((got_out, got_lse), low, (dout.to(dtype), dlse.float()))
        for g, w in zip(got, want):
            assert g.dtype == dtype and rel_error(g, w) <= GRAD_TOLERANCE[dtype]


@pytest.mark.parametrize("option", ["causal", "softcap", "bias", "all"])
def test_bf16_tile_head_dims_match_float64_reference(option):
    # H % 32 == 0 and Hv % 32 == 0: on the avx512bf16 and amx tiers both passes run on the bf16
    # product engine.
    bias, mask, kwargs = _split(OPTIONS[option])
    q, k, v = make_qkv(2, 19, 29, 6, 2, 64, 32, torch.float64, requires_grad=True)  # OPTIONS: T=19, S=29
    bias = None if bias is None else bias.double().requires_grad_(True)
    assert_gradients_match_float64_reference(q, k, v, bias, mask, kwargs, [torch.bfloat16])


@pytest.mark.parametrize("option", ["plain", "causal", "window", "lengths", "segments", "softcap", "bias", "all"])
@pytest.mark.parametrize("num_threads", THREAD_COUNTS, ids=lambda n: f"{n}threads", indirect=True)
def test_gradients_match_float64_reference(option, num_threads):
    bias, mask, kwargs = _split(OPTIONS[option])
    q, k, v = make_qkv(2, 19, 29, 6, 2, 16, 24, torch.float64, requires_grad=True)
    bias = None if bias is None else bias.double().requires_grad_(True)
    assert_gradients_match_float64_reference(q, k, v, bias, mask, kwargs,
                                             [torch.float32, torch.bfloat16, torch.float16])


@pytest.mark.parametrize("h,hv,dtype", [(256, 128, torch.float32), (256, 256, torch.bfloat16), (7, 9, torch.float32),
                                         (9, 3, torch.float16)])
def test_gradients_of_large_and_odd_head_dims_match_float64_reference(h, hv, dtype):
    # Head dims up to 256 (the bf16 engine's whole tiles at 256) and ones no vector width divides.
    q, k, v = make_qkv(2, 11, 23, 4, 2, h, hv, torch.float64, requires_grad=True)
    assert_gradients_match_float64_reference(q, k, v, None, None, {"is_causal": True, "logits_soft_cap": 3.0},
                                             [dtype])


def _assert_masked_call_matches_reference(q, k, v, bias=None, mask=None, configs=None, **kwargs):
    """Output and gradients (q, k, v and the bias) of the kernel against the float64 reference."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)] + ([bias.detach().requires_grad_(True)] if bias is not None else [])
    out = dpa.kernel(*leaves[:3], leaves[3] if bias is not None else None, mask, configs=configs, **kwargs)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    wide = [x.detach().double().requires_grad_(True) for x in leaves]
    want = dpa.reference(*wide[:3], wide[3] if bias is not None else None, mask, **kwargs)
    want_grads = torch.autograd.grad(want, wide, torch.ones_like(want))
    dtype = q.dtype
    assert rel_error(out, want) <= TOLERANCE[dtype]
    for g, w in zip(grads, want_grads):
        assert rel_error(g, w) <= GRAD_TOLERANCE[dtype]
    return out, want


_TILES = (dpa.Config(block_q=32, block_kv=64, num_splits=1),) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_shape", ["t,s", "b,n,t,s"])
def test_bool_mask_tiles_hidden_whole_shown_whole_or_by_one_key(dtype, mask_shape):
    # The kernel skips kv tiles a bool mask hides from every row of a task and applies no mask
    # to tiles it shows whole (ClassifyTile). 64-key tiles over 200 keys: a causal mask as a
    # tensor has both kinds (and diagonal ones); one key left visible in an otherwise hidden
    # band must keep its tile (fp32 sees a dropped key: it carries ~1/88 of its row's weight).
    t = s = 200
    q, k, v = make_qkv(2, t, s, 4, 2, 16, dtype=dtype)
    causal = torch.ones(t, s, dtype=torch.bool).tril()
    banded = causal.clone()
    banded[100:, 64:128] = False  # a whole tile hidden from the later query blocks...
    banded[150, 70] = True        # ...but for one key of one row
    for name, mask in {"causal": causal, "banded": banded}.items():
        full = mask.expand(2, 4, t, s).contiguous() if mask_shape == "b,n,t,s" else mask
        out, want = _assert_masked_call_matches_reference(q, k, v, mask=full, configs=_TILES)
        if name == "causal":
            torch.testing.assert_close(out, dpa.kernel(q, k, v, is_causal=True, configs=_TILES), rtol=1e-6, atol=1e-6)
        elif dtype == torch.float32:
            assert rel_error(out[:, 150], want[:, 150]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bool_mask_per_head_and_batch_with_other_masks_and_bias(dtype):
    # A mask that differs per batch and per head of one GQA group (so rows of one task differ),
    # hiding whole tiles from some heads only, combined with segment ids, query lengths and the
    # causal flag, with a bias whose gradient must be 0 where tiles were skipped; and the decode
    # row path (one query) over 300 keys.
    b, t, s, n, kv = 2, 200, 200, 4, 2
    q, k, v = make_qkv(b, t, s, n, kv, 16, dtype=dtype)
    mask = torch.ones(b, n, t, s, dtype=torch.bool)
    mask[1, 1, 100:, 64:128] = False  # batch 1, the group's second head: a tile hidden from it alone
    mask[0, 3, :, :64] = False        # batch 0, head 3: the first tile hidden...
    mask[0, 3, 120, 10] = True        # ...but for one key of one query
    mask[1, 0, :, 128:192] = False    # batch 1, a group's first head only: a scan of one head per
                                      # group would skip the tile its second head sees
    mask[0, :, :, 192:] = False       # the last tile hidden in batch 0 only: batch 1 must not read it
    bias = torch.randn(b, n, t, s).to(dtype)
    _assert_masked_call_matches_reference(q, k, v, bias=bias, mask=mask, configs=_TILES)
    segments = torch.tensor([[0] * 120 + [1] * 80, [0] * 60 + [1] * 140], dtype=torch.int32)
    _assert_masked_call_matches_reference(q, k, v, bias=bias, mask=mask, configs=_TILES, is_causal=True,
                                          q_segment_ids=segments, kv_segment_ids=segments,
                                          query_seq_lengths=torch.tensor([170, 200]))
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)] + [bias.detach().requires_grad_(True)]
    out = dpa.kernel(*leaves[:3], leaves[3], mask, configs=_TILES)
    dbias = torch.autograd.grad(out, leaves[3], torch.ones_like(out))[0]
    assert torch.equal(dbias[~mask], torch.zeros_like(dbias[~mask]))  # skipped tiles add nothing
    qd, kd, vd = make_qkv(b, 1, 300, n, kv, 16, dtype=dtype)
    decode_mask = torch.ones(b, n, 1, 300, dtype=torch.bool)
    decode_mask[0, :2, :, 64:192] = False
    decode_mask[1, 3, :, :256] = False
    _assert_masked_call_matches_reference(qd, kd, vd, mask=decode_mask, configs=_TILES)


def _outputs_and_grads(q, k, v, **kwargs):
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = dpa.kernel(*leaves, **kwargs)
    return (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bool_mask_of_one_run_per_row_is_the_ranges_it_spells(dtype):
    # A bool mask each row of which shows one run of keys (causal, window, padding: what
    # transformers passes) is folded into per-row ranges (FoldMaskRuns): the same call as the
    # flags that spell it, bit for bit, with the heuristic configs (a mask counts as block
    # sparse) and explicit ones, forward and gradients, on the tile and the decode row paths.
    b, t, n, kv = 2, 200, 4, 2
    q, k, v = make_qkv(b, t, t, n, kv, 16, dtype=dtype)
    i = torch.arange(t)
    causal = i[None, :] <= i[:, None]
    window = causal & (i[None, :] > i[:, None] - 30)
    lengths = torch.tensor([130, 200])
    padding = (i[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, S]
    spelled = [({"mask": causal}, {"is_causal": True}),
               ({"mask": window}, {"is_causal": True, "local_window_size": (29, 0)}),
               ({"mask": padding}, {"key_value_seq_lengths": lengths}),
               ({"mask": padding & causal}, {"key_value_seq_lengths": lengths, "is_causal": True})]
    for configs in (None, _TILES):
        for as_mask, as_flags in spelled:
            got = _outputs_and_grads(q, k, v, configs=configs, **as_mask)
            want = _outputs_and_grads(q, k, v, configs=configs, **as_flags)
            assert all(torch.equal(x, y) for x, y in zip(got, want)), (sorted(as_flags), configs)
    qd, kd, vd = make_qkv(b, 1, 300, n, kv, 16, dtype=dtype)
    decode_lengths = torch.tensor([1, 257])
    decode_padding = (torch.arange(300)[None, :] < decode_lengths[:, None])[:, None, None, :]
    got = _outputs_and_grads(qd, kd, vd, mask=decode_padding)
    want = _outputs_and_grads(qd, kd, vd, key_value_seq_lengths=decode_lengths)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bool_mask_runs_per_head_and_batch_and_one_row_that_is_not_a_run(dtype):
    # Runs that differ per head of a GQA group and per batch, one row showing no key (zero output
    # and gradients, no NaN) and one not starting at key 0: against the float64 reference. Then
    # the same mask with one row of two runs, which the kernel cannot fold: the per-element path.
    b, t, n, kv = 2, 200, 4, 2
    q, k, v = make_qkv(b, t, t, n, kv, 16, dtype=dtype)
    i = torch.arange(t)
    mask = torch.zeros(b, n, t, t, dtype=torch.bool)
    for batch in range(b):
        for head in range(n):
            width = 7 + 40 * head + 13 * batch
            mask[batch, head] = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - width)
    mask[1, 2, 50] = False               # a row that sees nothing
    mask[0, 1, 120] = False
    mask[0, 1, 120, 150:190] = True      # a run past the diagonal
    out, _ = _assert_masked_call_matches_reference(q, k, v, mask=mask, configs=_TILES)
    assert torch.equal(out[1, 50, 2], torch.zeros_like(out[1, 50, 2]))
    two_runs = mask.clone()
    two_runs[0, 3, 180, 5:9] = True
    _assert_masked_call_matches_reference(q, k, v, mask=two_runs, configs=_TILES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [3, 200])  # the decode row path and the tile path
def test_rows_masked_whole_by_a_huge_negative_bias_get_the_reference_gradients(dtype, t):
    # An additive mask of finfo.min over a whole row (what a caller building transformers-style
    # float masks passes for a padded query): every logit of the row is ~-3.4e38, where fp32 lse
    # cannot hold log(S) beside the max, so P = exp(s - lse) would sum to S, not 1 (dq off by 2,
    # found by an input audit). The backward renormalises such rows. The oracle is the reference
    # in fp32: at these magnitudes fp32 logits themselves drop q·k (a float64 oracle keeps it
    # at -1e9), and the kernel's logits are fp32 by contract.
    q, k, v = make_qkv(2, t, 150, 4, 2, 16, dtype=dtype)
    for fill in (torch.finfo(torch.float32).min, -1e9, -3e3):
        bias = torch.zeros(2, 1, t, 150)
        bias[0, :, 1] = fill                 # a whole row
        bias[1, :, t - 1, :100] = fill        # a partial row: an ordinary mask
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out = dpa.kernel(*leaves, bias.to(dtype), configs=_TILES)
        cotangent = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, cotangent)
        wide = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
        want = dpa.reference(*wide, bias.to(dtype).float())
        want_grads = torch.autograd.grad(want, wide, cotangent.float())
        assert rel_error(out, want) <= TOLERANCE[dtype], fill
        for g, w in zip(grads, want_grads):
            assert rel_error(g, w) <= GRAD_TOLERANCE[dtype], fill


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [2, 100])
@pytest.mark.parametrize("h,cap", [(16, None), (64, 5.0)])  # 64: bf16 on the bf16 engine, with a soft cap
def test_rows_that_see_no_key_send_zero_gradients_even_from_nan_inputs(dtype, t, h, cap):
    # Padded query rows (past query_seq_lengths, or masked whole) may hold garbage, NaN
    # included, in q and in the output's cotangent: their gradients to q, k, v and the bias are
    # exactly zero and no NaN reaches the other rows' (dS = 0 there, their q and dO rows zeroed;
    # the bf16 engine reads q unzeroed, so a capped row's slope is NaN: dS is zeroed after it).
    q, k, v = make_qkv(2, t, 70, 4, 2, h, dtype=dtype)
    q[:, t - 1] = math.nan
    lengths = torch.tensor([t - 1, t - 1])
    mask = torch.ones(2, 4, t, 70, dtype=torch.bool)
    mask[:, :, t - 1] = False
    bias = torch.randn(2, 4, t, 70).to(dtype)
    for kwargs in ({"query_seq_lengths": lengths}, {"mask": mask}):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v, bias)]
        out = dpa.kernel(*leaves, configs=_TILES, logits_soft_cap=cap, **kwargs)
        cotangent = torch.randn_like(out)
        cotangent[:, t - 1] = math.nan
        grads = torch.autograd.grad(out, leaves, cotangent)
        assert torch.equal(out[:, t - 1], torch.zeros_like(out[:, t - 1]))
        for grad in grads:
            assert not grad.isnan().any()
        assert torch.equal(grads[0][:, t - 1], torch.zeros_like(grads[0][:, t - 1]))
        assert torch.equal(grads[3][:, :, t - 1], torch.zeros_like(grads[3][:, :, t - 1]))
        clean = [x.detach().clone().requires_grad_(True) for x in (q, k, v, bias)]
        with torch.no_grad():
            clean[0][:, t - 1] = 0.0
        want = torch.autograd.grad(dpa.kernel(*clean, configs=_TILES, logits_soft_cap=cap, **kwargs), clean,
                                   torch.nan_to_num(cotangent, nan=0.0))
        for grad, w in zip(grads[1:3], want[1:3]):  # dk, dv: as if the padded rows held zeros
            torch.testing.assert_close(grad, w, rtol=0, atol=0)


@pytest.mark.parametrize("t", [4, 200])  # 4 x 2 heads: the decode row path
@pytest.mark.parametrize("splits", [1, 3])  # the kv sequence whole, or split and merged
def test_nan_and_overflowed_logits_propagate_and_are_not_taken_for_masked_rows(t, splits):
    # A NaN query, or logits past fp32's range, give NaN in that row's output and logsumexp, as
    # the reference does; a row that sees no key still gives exactly 0 and -inf.
    q, k, v = make_qkv(1, t, 200, 2, 1, 16)
    q[0, 1, 0, 0] = math.nan
    q[0, 2, 1] *= 1e20
    k = k * 1e20
    configs = (dpa.Config(block_q=32, block_kv=64, num_splits=splits),) * 2
    out, lse = dpa.kernel(q, k, v, return_residuals=True, configs=configs, query_seq_lengths=torch.tensor([t - 1]))
    assert out[0, 1, 0].isnan().all() and lse[0, 0, 1].isnan()
    assert out[0, 2, 1].isnan().all() and lse[0, 1, 2].isnan()
    assert torch.equal(out[0, t - 1], torch.zeros_like(out[0, t - 1])) and (lse[0, :, t - 1] == -math.inf).all()
    assert not out[0, 0].isnan().any() and not lse[0, :, 0].isnan().any()
    want, want_lse = dpa.reference(q, k, v, return_residuals=True, query_seq_lengths=torch.tensor([t - 1]))
    # (the overflowed row's lse: +inf in the reference, NaN in the kernel; both not finite)
    assert torch.equal(want.isnan(), out.isnan()) and torch.equal(want_lse.isfinite(), lse.isfinite())


def test_a_zero_width_value_still_gives_the_logsumexp_and_its_gradient():
    # value_dim 0: no output, but lse is a real result (and differentiable), not -inf.
    q, k, _ = make_qkv(1, 5, 7, 2, 1, 8, dtype=torch.float64)
    v = torch.randn(1, 7, 1, 0, dtype=torch.float64)
    for impl in (dpa.kernel, dpa.reference):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out, lse = impl(*leaves, return_residuals=True)
        assert out.shape == (1, 5, 2, 0)
        grads = torch.autograd.grad(lse.sum(), leaves[:2])
        if impl is dpa.kernel:
            got = (lse, *grads)
        else:
            want = (lse, *grads)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9)
    one = torch.randn(1, 7, 1, 1, dtype=torch.float64)  # lse does not depend on the values
    assert torch.equal(dpa.kernel(q, k, one, return_residuals=True)[1], got[0])
    q32, k32, v32 = (x.float() for x in (q, k, v))
    _, lse32 = dpa.kernel(q32, k32, v32, return_residuals=True)
    torch.testing.assert_close(lse32, want[0].float(), rtol=1e-6, atol=1e-6)


def test_saturated_soft_cap_gradients_keep_their_relative_precision():
    # Every logit deep in the cap's saturation (|logit / cap| ~ 6.7, found by the property test):
    # the cap's slope 1 - tanh² is ~7e-6, and taken from a float tanh it cancels to 3e-3 relative
    # error (PyTorch's fp32 autograd of the same formula). The kernel computes it apart from tanh.
    q = torch.tensor([[[[1.5410, -0.2934, -2.1788, 0.5684]]]], dtype=torch.float64, requires_grad=True)
    k = torch.tensor([[[[-1.0845, -1.3986, 0.4033, 0.8380]]]], dtype=torch.float64, requires_grad=True)
    v = torch.tensor([[[[-0.7193]]]], dtype=torch.float64, requires_grad=True)
    kwargs = {"logits_soft_cap": 0.5, "scale": 2.0}
    out, lse = dpa.reference(q, k, v, return_residuals=True, **kwargs)
    want = torch.autograd.grad(lse.sum(), (q, k))
    low = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    _, got_lse = dpa.kernel(*low, return_residuals=True, **kwargs)
    got = torch.autograd.grad(got_lse.sum(), low[:2])
    for g, w in zip(got, want):
        assert w.abs().max() < 1e-4  # the slope is tiny: the case tests precision, not size
        assert rel_error(g, w) < 1e-5


@pytest.mark.parametrize("shape", [(1, 4, 9, 13), (4, 9, 13), (9, 13)])
def test_bias_shared_by_the_batches_gets_the_batches_summed_gradient(shape):
    # The kernel sums a shared bias's gradient over the batches as it goes (no [B, N, T, S]
    # buffer): the same bits as the per-batch gradients of a bias repeated B times, added in
    # batch order (B = 2: one addition, so torch's sum has that order too), then over the heads
    # as before.
    q, k, v = make_qkv(2, 9, 13, 4, 2, 16)
    bias = torch.randn(shape, requires_grad=True)
    per_batch = bias.detach().expand(2, 4, 9, 13).clone().requires_grad_(True)
    dout = torch.randn(2, 9, 4, 16)
    for b in (bias, per_batch):
        (dpa.kernel(q, k, v, b, is_causal=True, logits_soft_cap=5.0) * dout).sum().backward()
    assert torch.equal(bias.grad, per_batch.grad.sum(0, keepdim=True).sum_to_size(shape))


def test_shared_bias_gradient_is_the_same_bits_summed_in_the_kernel_or_after_it():
    # One batch of this problem has 2 tasks (2 kv heads, one query block): with 2 threads the
    # kernel sums the batches as it goes; with more threads than that it writes every batch and
    # the adapter adds them afterwards, in the same order. The bits must not depend on which.
    q, k, v = make_qkv(3, 9, 13, 4, 2, 16)
    bias = torch.randn(4, 9, 13)
    dout = torch.randn(3, 9, 4, 16)
    threads = torch.get_num_threads()
    grads = []
    try:
        for n in (2, 8):
            torch.set_num_threads(n)
            b = bias.clone().requires_grad_(True)
            (dpa.kernel(q, k, v, b, is_causal=True) * dout).sum().backward()
            grads.append(b.grad)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grads[0], grads[1])


def test_working_buffers_past_32_mib_match_float64_reference():
    # S=9000, 8 kv heads of 128: the backward's dK/dV partial sums (~38 MiB each) pass 32 MiB,
    # where LargeBuffer maps them itself (zeroed by the kernel) instead of taking them from malloc.
    q, k, v = make_qkv(1, 96, 9000, 8, 8, 128, dtype=torch.float64, requires_grad=True)
    out = dpa.reference(q, k, v)
    dout = torch.randn_like(out)
    want = (out,) + torch.autograd.grad(out, (q, k, v), dout)
    low = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    out = dpa.kernel(*low)
    got = (out,) + torch.autograd.grad(out, low, dout.float())
    for g, w in zip(got, want):
        assert rel_error(g, w) <= GRAD_TOLERANCE[torch.float32]


def test_gradient_of_logsumexp_alone(impl):
    q, k, v = make_qkv(1, 9, 11, 2, 1, 8, dtype=torch.float64, requires_grad=True)
    _, lse = impl(q, k, v, is_causal=True, return_residuals=True)
    got = torch.autograd.grad(lse.sum(), (q, k))
    want = torch.autograd.grad(oracle(q, k, v, is_causal=True)[1].sum(), (q, k))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("option", ["plain", "all"])
# One thread: thousands of tiny calls, whose thread barriers stall on a loaded machine.
@pytest.mark.parametrize("num_threads", [1], ids=["1thread"], indirect=True)
def test_gradcheck_float64(impl, option, num_threads):
    bias, mask, kwargs = _split(OPTIONS[option])
    q, k, v = make_qkv(2, 19, 29, 6, 2, 16, 24, torch.float64)
    q, k, v = q[:, :6, :, :4], k[:, :7, :, :4], v[:, :7, :, :3]  # small, strided slices
    bias = None if bias is None else bias[..., :6, :7].double()
    mask = None if mask is None else mask[..., :6, :7]
    kwargs = {key: (val[:, :6] if key == "q_segment_ids" else val[:, :7] if key == "kv_segment_ids" else val)
              for key, val in kwargs.items()}
    if "query_seq_lengths" in kwargs:
        kwargs["query_seq_lengths"] = torch.tensor([5, 6])
        kwargs["key_value_seq_lengths"] = torch.tensor([7, 3])
    inputs = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    if bias is not None:
        inputs.append(bias.detach().clone().requires_grad_(True))

    def fn(*xs):
        out, lse = impl(xs[0], xs[1], xs[2], xs[3] if len(xs) > 3 else None, mask, return_residuals=True, **kwargs)
        return out, lse.masked_fill(lse == -math.inf, 0.0)  # finite differences of -inf are NaN

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


# ---- special cases of the contract --------------------------------------------------------------

def test_opcheck_backward_op():
    q, k, v = make_qkv(2, 9, 13, 4, 2, 8, 8)
    bias = torch.randn(4, 9, 13)
    out, lse = dpa.kernel(q, k, v, bias, is_causal=True, return_residuals=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.library.opcheck(torch.ops.tokamax._dot_product_attention_backward.default, (
        dout, dlse, q, k, v, bias, None, out, lse, None, True, None, None, None, None, None, None, True, None))


# ---- configs ------------------------------------------------------------------------------------

def test_get_configs():
    q, k, v = make_qkv(1, 64, 64, 8, 2, 32)
    fwd, bwd = tokamax_torch.get_configs(dpa.kernel, q, k, v, is_causal=True)
    assert isinstance(fwd, dpa.Config) and isinstance(bwd, dpa.Config)
    assert fwd == dpa.kernel.config_space(q, k, v, is_causal=True)[0]
    assert bwd == dpa.kernel.config_space(q, k, v, is_causal=True, product="backward")[0]
    assert tokamax_torch.get_configs(dpa.reference, q, k, v) == (None, None)
    assert tokamax_torch.get_configs(dpa.kernel, q, k, v, is_causal=True, from_autotuning_cache=True) == (fwd, bwd)
    meta = [torch.empty(x, dtype=torch.bfloat16, device="meta") for x in
            ((8, 32768, 32, 128), (8, 32768, 8, 128), (8, 32768, 8, 128))]
    big = tokamax_torch.get_configs(dpa.kernel, *meta, is_causal=True)
    assert all(isinstance(c, dpa.Config) for c in big)
    decode = tokamax_torch.get_configs(dpa.kernel, *make_qkv(1, 1, 4096, 4, 1, 64))
    assert decode[0].num_splits > 1  # one query row still uses several threads


def test_config_query_ops_say_they_need_concrete_shapes():
    # The heuristic and the search space are host-side queries for concrete sizes (get_configs,
    # config_space); traced with symbolic sizes they raise a clear error.
    q, k, v = make_qkv(1, 8, 8, 4, 2, 16)
    for op in (torch.ops.tokamax._dot_product_attention_heuristic_config,
               torch.ops.tokamax._dot_product_attention_config_space):
        assert len(op(q, k, v, False, 0)) % len(dataclasses.fields(dpa.Config)) == 0
        compiled = torch.compile(lambda a, b, c, op=op: torch.tensor(op(a, b, c, False, 0)), dynamic=True,
                                 fullgraph=True)
        with pytest.raises(Exception, match="configs are chosen for concrete shapes"):
            compiled(q, k, v)


def test_invalid_config_rejected():
    # At the call, for both singletons, eager and compiled: CONTRACT.invalid_configs.
    with pytest.raises(RuntimeError, match="block_kv must be a multiple of 8"):
        dpa.Config(block_q=16, block_kv=12, num_splits=1)
    with pytest.raises(RuntimeError, match="num_splits must be in"):
        dpa.Config(block_q=16, block_kv=64, num_splits=0)
    with pytest.raises(TypeError, match="block_q must be an int"):
        dpa.Config(block_q=1.5, block_kv=64, num_splits=1)
    q, k, v = make_qkv(1, 8, 8, 2, 1, 8)
    with pytest.raises(TypeError, match="a config must be a Config"):
        dpa.kernel(q, k, v, configs=([16.0, 64, 1], None))


def test_autotune_and_cache_roundtrip(user_cache):
    q, k, v = make_qkv(1, 32, 64, 4, 2, 16)
    result = tokamax_torch.autotune(dpa.kernel, q, k, v, is_causal=True, reps=1, budget_s=5.0)
    fwd, bwd = result.configs
    assert isinstance(fwd, dpa.Config) and isinstance(bwd, dpa.Config)
    assert tokamax_torch.get_configs(dpa.kernel, q, k, v, is_causal=True, from_autotuning_cache=True) == (fwd, bwd)


def test_python_argument_errors():
    q, k, v = make_qkv(1, 4, 4, 2, 1, 8)
    with pytest.raises(TypeError, match="local_window_size must be an int w"):
        dpa.kernel(q, k, v, local_window_size=(1, 2, 3))
    with pytest.raises(TypeError, match="configs must be a \\(fwd, bwd\\) pair"):
        dpa.kernel(q, k, v, configs=dpa.Config(8, 64, 1))


# ---- property tests (run by tests/test_properties.py) ---------------------------------------

def _broadcast_shape(draw, full, name):
    """`full` with some leading dims dropped and some dims set to 1 (what broadcasting allows)."""
    drop = draw(st.integers(0, len(full) - 2), label=f"{name} dropped dims")
    return tuple(d if draw(st.booleans(), label=f"{name} dim {i}") else 1 for i, d in enumerate(full[drop:]))


@st.composite
def attention_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    b, t, s = draw(st.integers(0, 3), label="b"), draw(st.integers(0, 20), label="t"), draw(st.integers(0, 20), label="s")
    kv_heads, groups = draw(st.integers(1, 3), label="kv heads"), draw(st.integers(1, 3), label="groups")
    n = kv_heads * groups
    h, hv = draw(st.integers(1, 40), label="h"), draw(st.integers(1, 40), label="hv")
    q = layout(draw, (b, t, n, h), generator, dtype, "query")
    k = layout(draw, (b, s, kv_heads, h), generator, dtype, "key")
    v = layout(draw, (b, s, kv_heads, hv), generator, dtype, "value")
    bias = mask = None
    if draw(st.booleans(), label="bias"):
        bias = torch.randn(_broadcast_shape(draw, (b, n, t, s), "bias"), generator=generator).to(dtype)
    if draw(st.booleans(), label="mask"):
        mask = torch.rand(_broadcast_shape(draw, (b, n, t, s), "mask"), generator=generator) > 0.3
    kwargs = {"is_causal": draw(st.booleans(), label="causal")}
    window = st.one_of(st.none(), st.integers(0, 8), st.tuples(st.none() | st.integers(0, 8), st.none() | st.integers(0, 8)))
    kwargs["local_window_size"] = draw(window, label="window")
    if draw(st.booleans(), label="lengths"):
        length_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="length dtype")
        kwargs["query_seq_lengths"] = torch.tensor(draw(st.lists(st.integers(0, t), min_size=b, max_size=b)),
                                                   dtype=length_dtype)
        kwargs["key_value_seq_lengths"] = torch.tensor(draw(st.lists(st.integers(0, s), min_size=b, max_size=b)),
                                                       dtype=length_dtype)
    if draw(st.booleans(), label="segments"):
        kwargs["q_segment_ids"] = torch.randint(0, 3, (b, t), generator=generator, dtype=torch.int32)
        kwargs["kv_segment_ids"] = torch.randint(0, 3, (b, s), generator=generator, dtype=torch.int32)
    kwargs["logits_soft_cap"] = draw(st.none() | st.floats(0.5, 30.0), label="soft cap")
    kwargs["scale"] = draw(st.none() | st.floats(0.05, 2.0), label="scale")
    if kwargs["local_window_size"] is None:
        del kwargs["local_window_size"]
    return (q, k, v, bias, mask), {key: value for key, value in kwargs.items() if value is not None}


@settings(PROFILE, max_examples=200)
@given(problem=attention_problems())
def dot_product_attention_kernel_matches_float64_oracle(problem):
    args, kwargs = problem
    dtype = args[0].dtype
    out, lse = assert_matches_oracle(dpa.kernel, args, kwargs, dtype)
    assert not out.isnan().any() and not lse.isnan().any()


@settings(PROFILE, max_examples=60)
@given(problem=attention_problems())
def dot_product_attention_kernel_gradients_match_float64_reference(problem):
    torch.manual_seed(0)  # the output weights the helper draws: the same for an example run alone
    (q, k, v, bias, mask), kwargs = problem
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    bias = None if bias is None else bias.detach().double().requires_grad_(True)
    assert_gradients_match_float64_reference(*leaves, bias, mask, kwargs, [q.dtype])


PROPERTIES = [dot_product_attention_kernel_matches_float64_oracle,
              dot_product_attention_kernel_gradients_match_float64_reference]


# ---- the op contract (tests/test_op_contract.py) ------------------------------------------------

def _sample(b, t, s, n, k, h, hv=None, dtype=torch.float32, bias_shape=None, grad=True, **kwargs):
    def make():
        q, k_, v = make_qkv(b, t, s, n, k, h, hv, dtype, requires_grad=grad)
        bias = None if bias_shape is None else torch.randn(bias_shape).to(dtype).requires_grad_(grad)
        return (q, k_, v, bias), dict(kwargs)
    return make


def _masked_sample(dtype):
    def make():
        q, k, v = make_qkv(2, 9, 13, 4, 2, 8, 8, dtype, requires_grad=True)
        return (q, k, v, None, torch.rand(9, 13) > 0.3), dict(
            local_window_size=(3, 1), query_seq_lengths=torch.tensor([9, 4]), q_segment_ids=segment_ids(2, 9, 2),
            kv_segment_ids=segment_ids(2, 13, 2), return_residuals=True, configs=([4, 8, 2], [2, 16, 2]))
    return make


def _bad_inputs():
    q, k, v = make_qkv(2, 6, 7, 4, 2, 8)
    ids_q, ids_k = torch.zeros(2, 6, dtype=torch.int32), torch.zeros(2, 7, dtype=torch.int32)
    return [
        BadInput("number of query heads must be a multiple of the number of kv heads, got N = 4 and K = 3",
                 (q, torch.randn(2, 7, 3, 8), torch.randn(2, 7, 3, 8))),
        BadInput(r"key's head dim must equal query's \(8\)", (q, torch.randn(2, 7, 2, 5), v)),
        BadInput("query must be 4-D", (q[0], k, v)),
        BadInput("value must be \\[B, S, K, Hv\\] with S and K of key", (q, k, torch.randn(2, 6, 2, 8))),
        BadInput("query, key and value must have one dtype", (q, k.double(), v)),
        BadInput("query must be float32, bfloat16, float16 or float64, got Int", (q.int(), k.int(), v.int())),
        BadInput(r"bias must be broadcastable to \[B, N, T, S\]", (q, k, v, torch.randn(4, 6, 6))),
        BadInput(r"mask must be broadcastable to \[B, N, T, S\]", (q, k, v, None, torch.ones(3, 4, 6, 7, dtype=torch.bool))),
        BadInput("mask must be bool", (q, k, v, None, torch.ones(6, 7))),
        BadInput("q_segment_ids must be int32, got Long", (q, k, v), {"q_segment_ids": ids_q.long(), "kv_segment_ids": ids_k}),
        BadInput(r"kv_segment_ids must have shape \[B, S\] = \[2, 7\]", (q, k, v),
                 {"q_segment_ids": ids_q, "kv_segment_ids": ids_q}),
        BadInput("q_segment_ids and kv_segment_ids must be given together", (q, k, v), {"q_segment_ids": ids_q}),
        BadInput("logits_soft_cap must be a positive finite number, got 0", (q, k, v), {"logits_soft_cap": 0.0}),
        BadInput("logits_soft_cap must be a positive finite number, got -1", (q, k, v), {"logits_soft_cap": -1.0}),
        BadInput(r"local_window_size must be non-negative, got \(-1, 2\)", (q, k, v), {"local_window_size": (-1, 2)}),
        BadInput(r"local_window_size must be non-negative, got \(2, -1\)", (q, k, v), {"local_window_size": (2, -1)}),
        BadInput(r"local_window_size must be non-negative, got \(-3, -3\)", (q, k, v), {"local_window_size": -3}),
        BadInput(r"q_segment_ids must have shape \[B, T\] = \[2, 6\]", (q, k, v),
                 {"q_segment_ids": ids_k, "kv_segment_ids": ids_k}),
        BadInput("query_seq_lengths must have B = 2 entries", (q, k, v), {"query_seq_lengths": torch.tensor([1, 2, 3])}),
        BadInput("key_value_seq_lengths must be int32 or int64", (q, k, v),
                 {"key_value_seq_lengths": torch.tensor([1.0, 2.0])}),
        # Value checks: only the kernel reads length values (the reference treats them as masks).
        BadInput(r"query_seq_lengths must lie in \[0, 6\], got query_seq_lengths\[1\] = 7", (q, k, v),
                 {"query_seq_lengths": torch.tensor([1, 7])}, kernel_only=True),
        BadInput(r"key_value_seq_lengths must lie in \[0, 7\], got key_value_seq_lengths\[0\] = -1", (q, k, v),
                 {"key_value_seq_lengths": torch.tensor([-1, 2])}, kernel_only=True),
    ]


def _square(b, t):
    return tuple(make_qkv(b, t, t, 4, 2, 8, requires_grad=True)), {"is_causal": True}


def _prefill_or_decode(t, s):
    return tuple(make_qkv(1, t, s, 4, 2, 8, requires_grad=True)), {"is_causal": True}


CONTRACT = OpContract(
    name="dot_product_attention",
    reference=dpa.reference,
    kernel=dpa.kernel,
    samples=[
        Sample("bias-causal-softcap-float32", _sample(2, 9, 13, 4, 2, 8, bias_shape=(4, 9, 13), is_causal=True,
                                                      logits_soft_cap=3.0)),
        Sample("bias-causal-softcap-bfloat16", _sample(2, 9, 13, 4, 2, 8, dtype=torch.bfloat16, bias_shape=(4, 9, 13),
                                                       is_causal=True, logits_soft_cap=3.0), compile=False),
        Sample("mask-window-lengths-segments-configs-float32", _masked_sample(torch.float32)),
        Sample("mask-window-lengths-segments-configs-bfloat16", _masked_sample(torch.bfloat16), compile=False),
        # The kernel's paths: several query blocks and kv tiles; the row path of decoding.
        Sample("gqa-causal-softcap", _sample(2, 50, 70, 4, 2, 16, is_causal=True, logits_soft_cap=5.0), reference=False),
        Sample("decode", _sample(2, 1, 300, 8, 2, 64, scale=0.2), reference=False),
    ],
    bad_inputs=_bad_inputs,
    invalid_configs=[
        ("expected 3 values", ([16, 64], None)),
        ("block_kv", ([16, 60, 1], None)),
        ("bwd_config: dot_product_attention config: block_q", (None, [0, 64, 1])),
    ],
    config_samples={
        "forward": Sample("long-s", _sample(1, 64, 300, 4, 2, 32)),
        "backward": Sample("long-s", _sample(1, 64, 300, 4, 2, 32)),
    },
    dynamic=[
        DynamicSizes("batch-and-length", _square, [{"b": 3, "t": 10}, {"b": 5, "t": 17}, {"b": 6, "t": 33}],
                     {"b": (2, 64), "t": (2, 4096)}, lambda d: ({0: d["b"], 1: d["t"]},) * 3),
        # T and S apart: one program for prefill (T = S), T < S and decode.
        DynamicSizes("query-and-key-lengths", _prefill_or_decode, [{"t": 24, "s": 40}, {"t": 7, "s": 61}, {"t": 9, "s": 33}],
                     {"t": (1, 4096), "s": (2, 4096)}, lambda d: ({1: d["t"]}, {1: d["s"]}, {1: d["s"]}),
                     export_only_sizes=[{"t": 33, "s": 33}, {"t": 1, "s": 90}]),
    ],
    determinism_samples=[
        Sample("causal", _sample(1, 64, 300, 4, 2, 32, is_causal=True, return_residuals=True)),
        # A bias shared by the batches: its gradient summed in the kernel or after it.
        Sample("shared-bias", _sample(3, 9, 13, 4, 2, 16, bias_shape=(4, 9, 13), is_causal=True)),
        Sample("decode-bf16", _sample(2, 1, 300, 8, 2, 64, 96, dtype=torch.bfloat16, logits_soft_cap=2.0)),
    ],
)
