"""moe_permute: a Python stable-sort oracle (exact: integer outputs), the ragged_dot round trip,
its errors, its CONTRACT and its property test."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import THREAD_COUNTS, BadInput, DynamicSizes, OpContract, Sample
from strategies import PROFILE
from tokamax_torch.ops import moe_permute as mp


def oracle(expert_indices, num_experts):
    """Sorted by (id, flattened position), written out with Python's sort (stable by the key)."""
    flat = expert_indices.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=lambda i: (flat[i], i))
    inverse = [0] * len(flat)
    for i, pos in enumerate(order):
        inverse[pos] = i
    sizes = [flat.count(e) for e in range(num_experts)]
    return (torch.tensor(order, dtype=torch.int64), torch.tensor(inverse, dtype=torch.int64),
            torch.tensor(sizes, dtype=torch.int32))


def assert_matches_oracle(expert_indices, num_experts, got):
    want = oracle(expert_indices, num_experts)
    for name, g, w in zip(("order", "inverse", "group_sizes"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape)
        assert torch.equal(g, w), f"{name}\n{g}\nwant\n{w}"


def routed(tokens, k, experts, dtype=torch.int32, seed=0, skew=True):
    """k distinct-or-not ids per token; skewed (a third to expert 1) so ties run long."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, k), generator=g)
    if skew:
        ids[torch.rand(tokens, k, generator=g) < 0.33] = min(1, experts - 1)
    return ids.to(dtype)


IMPLS = [(mp.reference, None)] + [(mp.kernel, n) for n in THREAD_COUNTS]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("impl,num_threads", IMPLS, indirect=["num_threads"])
@pytest.mark.parametrize("tokens,k,experts", [(13, 2, 4), (1, 1, 1), (0, 4, 3), (300, 8, 64), (9000, 2, 7)])
def test_matches_oracle(impl, num_threads, dtype, tokens, k, experts):
    ids = routed(tokens, k, experts, dtype, seed=tokens + k)
    assert_matches_oracle(ids, experts, impl(ids, experts))
    transposed = routed(k, tokens, experts, dtype, seed=k).t()  # strided [T, k]
    assert_matches_oracle(transposed, experts, impl(transposed, experts))


@pytest.mark.parametrize("impl", [mp.reference, mp.kernel], ids=["reference", "kernel"])
def test_feeds_ragged_dot_and_inverts(impl):
    # The MoE dispatch: rows grouped by expert, a per-expert product, back to (token, slot) order.
    from tokamax_torch.ops import ragged_dot as rd
    tokens, k, experts, hidden, out_dim = 17, 2, 5, 8, 6
    x = torch.randn(tokens, hidden)
    w = torch.randn(experts, hidden, out_dim)
    ids = routed(tokens, k, experts, skew=False)
    order, inverse, group_sizes = impl(ids, experts)
    y = rd.kernel(x[order // k], w, group_sizes)[inverse].view(tokens, k, out_dim)
    want = torch.einsum("th,tkho->tko", x, w[ids.long()])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", [mp.reference, mp.kernel], ids=["reference", "kernel"])
def test_unused_experts_have_zero_groups(impl):
    ids = torch.tensor([[3, 3], [0, 3]])
    order, inverse, group_sizes = impl(ids, 6)
    assert group_sizes.tolist() == [1, 0, 0, 3, 0, 0]
    assert order.tolist() == [2, 0, 1, 3] and inverse.tolist() == [1, 2, 0, 3]


# ---- the contract ----------------------------------------------------------------------------

def _sample(tokens, k, experts, dtype=torch.int32, transposed=False):
    def make():
        ids = routed(k, tokens, experts, dtype).t() if transposed else routed(tokens, k, experts, dtype)
        return (ids, experts), {}
    return make


CONTRACT = OpContract(
    name="moe_permute",
    reference=mp.reference,
    kernel=mp.kernel,
    samples=[
        Sample("int32", _sample(12, 2, 8)),
        Sample("int64-transposed", _sample(9, 4, 5, torch.int64, transposed=True)),
    ],
    bad_inputs=lambda: [
        BadInput(r"moe_permute: expert_indices must be 2-D \[T, k\], got shape \[4\]",
                 (torch.zeros(4, dtype=torch.int32), 2)),
        BadInput("moe_permute: expert_indices must be int32 or int64, got Float", (torch.zeros(2, 3), 2)),
        BadInput("moe_permute: num_experts must be >= 1, got 0", (torch.zeros(2, 3, dtype=torch.int32), 0)),
        BadInput(r"moe_permute: expert_indices\[1, 0\] must be in \[0, num_experts=4\), got 4",
                 (torch.tensor([[0, 1], [4, 2], [-1, 0]]), 4)),
        BadInput(r"moe_permute: expert_indices\[0, 1\] must be in \[0, num_experts=3\), got -2",
                 (torch.tensor([[0, -2]], dtype=torch.int32), 3)),
    ],
    # T symbolic; its sizes differ from k=2 and num_experts=6.
    dynamic=[DynamicSizes("tokens", lambda t: ((routed(t, 2, 6), 6), {}), [{"t": 5}, {"t": 9}, {"t": 17}],
                          {"t": (2, 4096)}, lambda dims: ({0: dims["t"]}, None), export_only_sizes=[{"t": 1}])],
    determinism_samples=[Sample("many-tokens", _sample(40000, 8, 64))],
)


# ---- property test -----------------------------------------------------------------------------

@st.composite
def moe_permute_problems(draw):
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    tokens, k = draw(st.integers(0, 300), label="T"), draw(st.integers(1, 8), label="k")
    experts = draw(st.integers(1, 40), label="experts")
    ids = routed(tokens, k, experts, draw(st.sampled_from([torch.int32, torch.int64])), seed=seed,
                 skew=draw(st.booleans(), label="skew"))
    if draw(st.booleans(), label="transposed"):
        ids = ids.t().contiguous().t()
    return ids, experts


@settings(PROFILE, max_examples=150)
@given(problem=moe_permute_problems())
def moe_permute_kernel_matches_oracle(problem):
    ids, experts = problem
    assert_matches_oracle(ids, experts, mp.kernel(ids, experts))


PROPERTIES = [moe_permute_kernel_matches_oracle]
