"""kv_cache_update: numerics against a per-token oracle (exact: it is a copy), its special cases,
the donation of kv_cache in the shapes users compile it in, and its CONTRACT (the shared suite
adds the donation proofs: same storage, no copy in Inductor code, peak RSS, compiled == eager)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._inductor.utils import run_and_get_code

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample, copies_in_code
from strategies import DTYPES, PROFILE, layout
from tokamax_torch.ops import kv_cache_update as kvc

ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def oracle(kv_cache, keys, values, slot_mapping):
    """A new cache: token t's K of head h at merged head 2h, its V at 2h+1, of its slot's row."""
    out = kv_cache.clone()
    pages, page_size = kv_cache.shape[:2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot == -1:
            continue
        page, offset = divmod(slot, page_size)
        out[page, offset, 0::2] = keys[t]
        out[page, offset, 1::2] = values[t]
    return out


def problem(pages=6, page_size=3, heads=2, d=8, tokens=5, dtype=torch.float32, index_dtype=torch.int64,
            skip=(), generator=None):
    """A cache of random values, T tokens at distinct random slots, `skip` tokens padding (-1)."""
    g = generator or torch.Generator().manual_seed(pages * 1000 + tokens)
    cache = torch.randn(pages, page_size, 2 * heads, d, generator=g).to(dtype)
    keys = torch.randn(tokens, heads, d, generator=g).to(dtype)
    values = torch.randn(tokens, heads, d, generator=g).to(dtype)
    slots = torch.randperm(pages * page_size, generator=g)[:tokens]
    slots[list(skip)] = -1
    return cache, keys, values, slots.to(index_dtype)


def bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                                    b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("impl,num_threads", [(kvc.reference, None)] + [(kvc.kernel, n) for n in THREAD_COUNTS],
                         indirect=["num_threads"])
def test_matches_oracle_exactly(impl, num_threads, dtype, index_dtype):
    cache, keys, values, slots = problem(pages=9, page_size=5, heads=3, d=17, tokens=23, dtype=dtype,
                                         index_dtype=index_dtype, skip=(0, 7, 22))
    want = oracle(cache, keys, values, slots)
    out = impl(cache, keys, values, slots)
    assert out is cache
    assert bits_equal(out, want)


@pytest.mark.parametrize("impl", [kvc.reference, kvc.kernel], ids=["reference", "kernel"])
def test_strided_keys_values_slots_and_padded_cache(impl):
    cache, keys, values, slots = problem(pages=7, page_size=4, heads=2, d=6, tokens=9)
    keys = torch.randn(6, 2, 9).transpose(0, 2)[:, :, :]  # [9, 2, 6] with stride 1 on T, not on D
    values = torch.randn(9, 4, 12)[:, 1::2, ::2]
    slots = torch.stack([slots, slots], 1)[:, 0]
    padded = torch.randn(7, 4, 4, 10)[..., 2:8]  # rows contiguous, padded
    # Pages not end to end (6 slots stored a page, 4 used): a slot's row is found through its page.
    spaced_pages = torch.randn(7, 6, 4, 6)[:, 1:5]
    for cache in (padded, spaced_pages):
        want = oracle(cache, keys, values, slots)
        assert impl(cache, keys, values, slots).data_ptr() == cache.data_ptr()
        assert bits_equal(cache, want)


@pytest.mark.parametrize("impl", [kvc.reference, kvc.kernel], ids=["reference", "kernel"])
def test_empty_and_all_padding_write_nothing(impl):
    for tokens, skip in ((0, ()), (4, (0, 1, 2, 3))):
        cache, keys, values, slots = problem(tokens=tokens, skip=skip)
        before = cache.clone()
        assert bits_equal(impl(cache, keys, values, slots), before)
    cache = torch.empty(0, 3, 4, 8)
    assert impl(cache, *problem(tokens=2, skip=(0, 1))[1:]).numel() == 0


def test_nan_and_inf_are_copied_bit_for_bit():
    cache, keys, values, slots = problem(dtype=torch.bfloat16)
    keys[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    want = oracle(cache, keys, values, slots)
    assert bits_equal(kvc.kernel(cache, keys, values, slots), want)


def test_a_layer_view_of_a_stacked_cache_compiles_without_copies():
    # Caches of all layers in one tensor, each call updating one layer's view: the graph input is
    # the stack, so functionalization sees a view mutation (the trap of pytorch#131192).
    stacked = torch.randn(3, 6, 3, 4, 8)
    _, keys, values, slots = problem()
    want = stacked.clone()
    oracle_layer = oracle(want[1], keys, values, slots)
    want[1] = oracle_layer

    def step(stack, k, v, s):
        return kvc.kernel(stack[1], k, v, s)

    out, codes = run_and_get_code(torch.compile(step, fullgraph=True), stacked, keys, values, slots)
    assert out.data_ptr() == stacked[1].data_ptr()
    assert bits_equal(stacked, want)
    assert not copies_in_code(codes, [stacked]), copies_in_code(codes, [stacked])


def test_a_module_buffer_cache_compiles_without_copies():
    # The cache as a module's buffer, updated then read in the same graph (a decode step).
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.randn(6, 3, 4, 8))

        def forward(self, k, v, s):
            cache = kvc.kernel(self.cache, k, v, s)
            return cache.sum(dim=(0, 1))

    eager, compiled = Decoder(), Decoder()
    compiled.load_state_dict(eager.state_dict())
    _, keys, values, slots = problem()
    want = eager(keys, values, slots)
    ptr = compiled.cache.data_ptr()
    out, codes = run_and_get_code(torch.compile(compiled, fullgraph=True), keys, values, slots)
    torch.testing.assert_close(out, want)  # Inductor's sum adds in its own order
    assert bits_equal(compiled.cache, eager.cache)
    assert compiled.cache.data_ptr() == ptr
    assert not copies_in_code(codes, [compiled.cache]), copies_in_code(codes, [compiled.cache])


def test_duplicate_slot_error_names_both_tokens():
    cache, keys, values, _ = problem(tokens=4)
    with pytest.raises(RuntimeError, match="got slot 5 for tokens 0 and 3"):
        kvc.kernel(cache, keys, values, torch.tensor([5, 2, -1, 5]))


# ---- the contract ----------------------------------------------------------------------------

def _sample(**kwargs):
    return lambda: (problem(**kwargs), {})


def _bad_inputs():
    cache, keys, values, slots = problem(tokens=4)
    keys16 = keys.half()
    shared = torch.randn(6, 3, 4, 8)
    bad = [
        BadInput(r"kv_cache must be 4-D \[total_pages, page_size, 2\*Hkv, D\], got shape \[18, 4, 8\]",
                 (cache.view(18, 4, 8), keys, values, slots)),
        BadInput(r"keys must be 3-D \[T, Hkv, D\], got shape \[4, 16\]", (cache, keys.view(4, 16), values, slots)),
        BadInput(r"values must have keys' shape \[4, 2, 8\], got shape \[4, 1, 8\]",
                 (cache, keys, values[:, :1], slots)),
        BadInput(r"slot_mapping must have one slot per token, \[T\] = \[4\], got shape \[3\]",
                 (cache, keys, values, slots[:3])),
        BadInput(r"kv_cache.shape\[2\] must be 2\*Hkv = 4", (cache[:, :, :2], keys, values, slots)),
        BadInput(r"kv_cache.shape\[3\] must be keys' D = 8", (torch.randn(6, 3, 4, 7), keys, values, slots)),
        BadInput("keys must have kv_cache's dtype Float, got Half", (cache, keys16, values, slots)),
        BadInput("values must have kv_cache's dtype Float, got Half", (cache, keys, values.half(), slots)),
        BadInput("kv_cache must be float32, bfloat16, float16 or float64, got Int",
                 (cache.int(), keys.int(), values.int(), slots)),
        BadInput("slot_mapping must be int32 or int64, got Float", (cache, keys, values, slots.float())),
        BadInput(r"kv_cache must have a contiguous last dimension \(stride 1\)",
                 (torch.randn(6, 3, 4, 16)[..., ::2], keys, values, slots)),
        BadInput(r"slot_mapping\[2\] must be -1 \(skip\) or in \[0, 18\) \(total_pages \* page_size\), got 18",
                 (cache, keys, values, torch.tensor([0, 1, 18, 2]))),
        BadInput(r"slot_mapping\[1\] must be -1 \(skip\) or in \[0, 18\)", (cache, keys, values, torch.tensor(
            [0, -2, 3, 2], dtype=torch.int32))),
        BadInput("slot_mapping must not repeat a slot", (cache, keys, values, torch.tensor([4, 1, -1, 4]))),
        # The donated buffer aliased: a stride-0 cache, keys that are a view of the cache.
        BadInput("kv_cache is written in place and must not overlap itself",
                 (torch.randn(1, 3, 4, 8).expand(6, 3, 4, 8), keys, values, slots)),
        BadInput("keys must not share memory with kv_cache, which the op writes in place",
                 (shared, shared[:4, 0, 0::2], values, slots)),
        BadInput("values must not share memory with kv_cache",
                 (shared, keys, shared.view(-1)[:64].view(4, 2, 8), slots)),
    ]
    return bad


def _donation_call(nbytes):
    """A bf16 cache of about `nbytes` (128 KiB pages: 16 tokens x 8 kv heads x 2 x 128 x 2 bytes),
    every page touched, and a prefill of 512 tokens."""
    page_bytes = 16 * 16 * 128 * 2
    pages = max(2, nbytes // page_bytes)
    cache = torch.ones(pages, 16, 16, 128, dtype=torch.bfloat16)
    tokens = min(512, pages * 16)
    keys = torch.randn(tokens, 8, 128).to(torch.bfloat16)
    values = torch.randn(tokens, 8, 128).to(torch.bfloat16)
    slots = torch.arange(tokens) * (pages * 16 // tokens)  # spread over the cache, distinct
    return (cache, keys, values, slots), {}


CONTRACT = OpContract(
    name="kv_cache_update",
    reference=kvc.reference,
    kernel=kvc.kernel,
    samples=[
        Sample("fp32", _sample(skip=(1,))),
        Sample("bf16-int32", _sample(pages=5, page_size=4, heads=1, d=16, tokens=7, dtype=torch.bfloat16,
                                     index_dtype=torch.int32)),
        Sample("unsorted-slots", _sample(pages=11, page_size=2, heads=4, d=3, tokens=13, skip=(12,)),
               compile=False),
    ],
    bad_inputs=_bad_inputs,
    # T (tokens) and P (pages) symbolic; their sizes differ from page_size 3, 2*Hkv 4 and D 8.
    dynamic=[DynamicSizes("tokens-pages", lambda t, p: (problem(pages=p, tokens=t, skip=(1,)), {}),
                          [{"t": 5, "p": 6}, {"t": 9, "p": 11}, {"t": 13, "p": 17}], {"t": (2, 64), "p": (5, 64)},
                          lambda dims: ({0: dims["p"]}, {0: dims["t"]}, {0: dims["t"]}, {0: dims["t"]}),
                          export_only_sizes=[{"t": 2, "p": 5}])],
    determinism_samples=[Sample("prefill", _sample(pages=300, page_size=16, heads=4, d=64, tokens=2000,
                                                   dtype=torch.bfloat16))],
    donation_call=_donation_call,
)


# ---- property test -----------------------------------------------------------------------------

@st.composite
def kv_cache_update_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = draw(st.sampled_from(DTYPES))
    pages, page_size = draw(st.integers(0, 9), label="pages"), draw(st.integers(1, 5), label="page_size")
    heads, d = draw(st.integers(1, 4), label="heads"), draw(st.integers(0, 20), label="d")
    tokens = draw(st.integers(0, pages * page_size), label="tokens")
    # Pages end to end or not (spare slots stored in each page), rows packed or padded.
    spare, padding = draw(st.sampled_from([0, 2]), label="spare_slots"), draw(st.sampled_from([0, 3]), label="padding")
    stored = torch.randn(pages, page_size + spare, 2 * heads, d + padding, generator=generator).to(dtype)
    cache = stored[:, spare:, :, padding:]
    keys = layout(draw, (tokens, heads, d), generator, dtype, "keys")
    values = layout(draw, (tokens, heads, d), generator, dtype, "values")
    slots = torch.randperm(pages * page_size, generator=generator)[:tokens]
    slots[torch.rand(tokens, generator=generator) < draw(st.sampled_from([0.0, 0.3]))] = -1
    return cache, keys, values, slots.to(draw(st.sampled_from([torch.int32, torch.int64])))


@settings(PROFILE, max_examples=150)
@given(problem=kv_cache_update_problems())
def kv_cache_update_kernel_matches_oracle(problem):
    cache, keys, values, slots = problem
    want = oracle(cache, keys, values, slots)
    assert bits_equal(kvc.kernel(cache, keys, values, slots), want)


PROPERTIES = [kv_cache_update_kernel_matches_oracle]
