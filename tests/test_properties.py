"""Property tests: each op's kernel on random problems against its float64 oracle.

Random shapes (0 and 1 included), strided and transposed views, every dtype and every option;
no crash, and no NaN where the oracle has none (the oracle checks compare finite entries and
require the same non-finite ones). Derandomized and without a database, so CI runs the same
examples every time; max_examples keeps each op well under a minute on 2 cores.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import test_dot_product_attention as attention
import test_ragged_dot as ragged
from tokamax_torch.ops import dot_product_attention as dpa
from tokamax_torch.ops import ragged_dot as rd

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PROFILE = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.function_scoped_fixture])


def _layout(draw, shape, generator, dtype, name):
    """A tensor of `shape` as a contiguous tensor, a transposed view of the reversed-last-two
    storage, a strided slice of a wider one, or (for a leading size of 1) an expanded one."""
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "expanded"]), label=f"{name} layout")
    shape = list(shape)
    if layout == "transposed" and len(shape) >= 2:
        storage = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=generator).to(dtype)
        return storage.transpose(-1, -2)
    if layout == "sliced" and shape:
        storage = torch.randn(*shape[:-1], 2 * shape[-1] + 1, generator=generator).to(dtype)
        return storage[..., 1::2]
    if layout == "expanded" and shape:
        return torch.randn(1, *shape[1:], generator=generator).to(dtype).expand(shape)
    return torch.randn(shape, generator=generator).to(dtype)


# ---- ragged_dot ---------------------------------------------------------------------------------

@st.composite
def ragged_problems(draw):
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    form = draw(st.sampled_from(list(ragged.FORMS.values())))
    dtype = draw(st.sampled_from(DTYPES))
    m, k, n = (draw(st.integers(0, 70), label=d) for d in "mkn")
    g = draw(st.integers(0, 5), label="g")
    # Group sizes summing to at most m: rows past their total are left to the kernel to zero.
    cuts = sorted(draw(st.lists(st.integers(0, m), min_size=g, max_size=g), label="cuts"))
    sizes = [b - a for a, b in zip([0] + cuts, cuts)]
    group_sizes = torch.tensor(sizes, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    lhs = _layout(draw, (m, k), generator, dtype, "lhs")
    rhs_shape = {rd.DEFAULT: (g, k, n), rd.TRANS_RHS: (g, n, k), rd.RAGGED_CONTRACTING: (m, n)}[form]
    rhs = _layout(draw, rhs_shape, generator, dtype, "rhs")
    preferred = draw(st.sampled_from([None, torch.float32, dtype]))
    return lhs, rhs, group_sizes, form, preferred


@settings(PROFILE, max_examples=400)
@given(problem=ragged_problems())
def test_ragged_dot_kernel_matches_float64_oracle(problem):
    lhs, rhs, group_sizes, form, preferred = problem
    out = rd.kernel(lhs, rhs, group_sizes, ragged_dot_dimension_numbers=form, preferred_element_type=preferred)
    assert out.dtype == (preferred or lhs.dtype)
    assert not out.isnan().any()
    # fp32 output of bf16/fp16 inputs: accumulated in fp32, no output rounding.
    tol = 2e-5 if out.dtype == torch.float32 else None
    ragged.assert_matches_oracle(out, lhs, rhs, group_sizes, form, tol=tol)


# ---- dot_product_attention ----------------------------------------------------------------------

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
    q = _layout(draw, (b, t, n, h), generator, dtype, "query")
    k = _layout(draw, (b, s, kv_heads, h), generator, dtype, "key")
    v = _layout(draw, (b, s, kv_heads, hv), generator, dtype, "value")
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
def test_dot_product_attention_kernel_matches_float64_oracle(problem):
    args, kwargs = problem
    dtype = args[0].dtype
    out, lse = attention.assert_matches_oracle(dpa.kernel, args, kwargs, dtype)
    assert not out.isnan().any() and not lse.isnan().any()


@settings(PROFILE, max_examples=60)
@given(problem=attention_problems())
def test_dot_product_attention_kernel_gradients_match_float64_reference(problem):
    torch.manual_seed(0)  # the output weights the helper draws: the same for an example run alone
    (q, k, v, bias, mask), kwargs = problem
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    bias = None if bias is None else bias.detach().double().requires_grad_(True)
    attention.assert_gradients_match_float64_reference(*leaves, bias, mask, kwargs, [q.dtype])
