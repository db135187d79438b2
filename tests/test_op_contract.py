"""The op contract, run for every op family that declares one (see tests/contract.py)."""

import importlib
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import tokamax_torch
from tokamax_torch import _registry
from tokamax_torch._op import record_configs
from torch._inductor.utils import run_and_get_code
from contract import (THREAD_COUNTS, all_tensors, assert_all_close, assert_all_equal, assert_ran_configs,
                      configs_as_lists, copies_in_code, donated, donation_peak_rss, first_output, forward_backward,
                      fresh_copy, is_low_precision, leaves, outputs, ran_products, schema_args, threads, with_configs)

# Every registered op family owes the contract: its test file, tests/test_<family>.py, declares
# its CONTRACT. A family without one fails here, so adding an op edits no list.
CONTRACTS = [importlib.import_module(f"test_{name}").CONTRACT for name in sorted(_registry.families())]
COMPILE_TOLERANCE = 1e-5  # eager against compiled: the same kernels, fused ATen ops around them


def _detached(call):
    args, kwargs = call
    strip = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return tuple(strip(x) for x in args), {key: strip(x) for key, x in kwargs.items()}


def _impl_samples(compiled=False, contracts=CONTRACTS):
    return [pytest.param(c, impl, s, id=f"{c.name}-{impl.name}-{s.id}")
            for c in contracts for impl in c.implementations for s in c.samples
            if (impl is c.kernel or s.reference) and (s.compile or not compiled)]


def _impl_dynamic(compiled=False, contracts=CONTRACTS):
    # Compiled, the reference takes the first case only: Inductor takes seconds to fuse its ATen ops.
    return [pytest.param(c, impl, d, id=f"{c.name}-{impl.name}-{d.id}")
            for c in contracts for impl in c.implementations for i, d in enumerate(c.dynamic)
            if impl is c.kernel or i == 0 or not compiled]


def _without_configs(contract, arity):
    """The one, skipped, case of a config check for an op without configs: the report says so."""
    return pytest.param(contract, *[None] * (arity - 1), id=f"{contract.name}-no-configs",
                        marks=pytest.mark.skip(reason=f"{contract.name} has no configs: config checks do not apply"))


def _kernel_samples(contracts=CONTRACTS):
    return [pytest.param(c, s, id=f"{c.name}-{s.id}") if c.kernel.tunable else _without_configs(c, 2)
            for c in contracts for s in (c.samples if c.kernel.tunable else c.samples[:1])]


def _products(contracts=CONTRACTS):
    return [param for c in contracts for param in
            ([pytest.param(c, p, id=f"{c.name}-{p}") for p in c.kernel.products] if c.kernel.tunable
             else [_without_configs(c, 2)])]


def _invalid_configs(contracts=CONTRACTS):
    return [param for c in contracts for param in
            ([pytest.param(c, impl, message, configs, id=f"{c.name}-{impl.name}-{message}")
              for impl in c.implementations for message, configs in c.invalid_configs] if c.kernel.tunable
             else [_without_configs(c, 4)])]


def _bad_inputs(contracts=CONTRACTS):
    return [pytest.param(c, impl, bad, id=f"{c.name}-{impl.name}-{bad.message}")
            for c in contracts for bad in c.bad_inputs() for impl in c.implementations
            if impl is c.kernel or not bad.kernel_only]


def _determinism_samples(contracts=CONTRACTS):
    return [pytest.param(c, s, id=f"{c.name}-{s.id}") for c in contracts for s in c.determinism_samples]


# ---- torch.library ------------------------------------------------------------------------------

@pytest.mark.parametrize("contract,impl,sample", _impl_samples())
def test_opcheck(contract, impl, sample):
    torch.library.opcheck(impl.op, schema_args(impl, sample.make()))


# ---- torch.compile and torch.export -------------------------------------------------------------

@pytest.mark.parametrize("contract,impl,sample", _impl_samples(compiled=True))
def test_compile_fullgraph_matches_eager(contract, impl, sample):
    def step(*args, **kwargs):
        # The op's inputs are intermediates of the graph, not only its inputs.
        tanh = lambda x: torch.tanh(x) if isinstance(x, torch.Tensor) and x.requires_grad else x  # noqa: E731
        return impl(*(tanh(x) for x in args), **{key: tanh(x) for key, x in kwargs.items()})

    call = sample.make()
    eager = forward_backward(step, call)
    compiled = forward_backward(torch.compile(step, fullgraph=True), call)
    assert_all_close(compiled, eager, COMPILE_TOLERANCE, "compiled against eager", is_low_precision(call))


@pytest.mark.parametrize("contract,impl,dynamic", _impl_dynamic(compiled=True))
def test_compile_dynamic_is_one_graph(contract, impl, dynamic):
    forward_counter = CompileCounterWithBackend("inductor")
    backward_counter = CompileCounterWithBackend("aot_eager")
    call_op = lambda *args, **kwargs: impl(*args, **kwargs)  # noqa: E731
    forward = torch.compile(call_op, backend=forward_counter, fullgraph=True, dynamic=True)
    backward = torch.compile(call_op, backend=backward_counter, fullgraph=True, dynamic=True)
    for sizes in dynamic.sizes:
        call = dynamic.make(**sizes)
        args, kwargs = _detached(call)
        assert_all_close([first_output(forward(*args, **kwargs))], [first_output(impl(*args, **kwargs))],
                         COMPILE_TOLERANCE, f"forward at {sizes}")
        if leaves(call):
            assert_all_close(forward_backward(backward, call), forward_backward(impl, call), COMPILE_TOLERANCE,
                             f"backward at {sizes}")
    assert forward_counter.frame_count == 1, "one graph for every size"
    assert backward_counter.frame_count == (1 if leaves(call) else 0), "one graph for every size"


@pytest.mark.parametrize("contract,impl,dynamic", _impl_dynamic())
def test_export_with_dynamic_dims(contract, impl, dynamic):
    args, kwargs = _detached(dynamic.make(**dynamic.sizes[0]))
    assert not any(isinstance(x, torch.Tensor) for x in kwargs.values()), "export takes tensors positionally"

    class Block(torch.nn.Module):
        def forward(self, *xs):
            return impl(*xs, **kwargs)

    dims = {name: torch.export.Dim(name, min=lo, max=hi) for name, (lo, hi) in dynamic.dims.items()}
    exported = torch.export.export(Block(), args, dynamic_shapes=(dynamic.dynamic_shapes(dims),))
    out_node = exported.graph.find_nodes(op="output")[0].args[0][0]
    assert any(isinstance(d, torch.SymInt) for d in first_output(out_node.meta["val"]).shape)
    if impl is contract.kernel:  # the kernel stays one op in the graph
        targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
        assert contract.kernel.op in targets
    for sizes in [*dynamic.sizes[1:], *dynamic.export_only_sizes]:
        args2, kwargs2 = _detached(dynamic.make(**sizes))
        assert kwargs2 == kwargs
        assert_all_close([first_output(exported.module()(*args2))], [first_output(impl(*args2, **kwargs))],
                         COMPILE_TOLERANCE, f"exported at {sizes}")


# ---- autocast (op_kit.h: the matrix-product families take PyTorch's "lower precision" policy) ----

LOWER_PRECISION_FAMILIES = {"ragged_dot", "dot_product_attention", "gated_linear_unit",
                            "linear_softmax_cross_entropy_loss", "fused_experts", "fused_moe"}


def _autocast_cast(impl, call, dtype):
    """The call as autocast runs it: floating inputs in `dtype` (leaves stay leaves), donated
    buffers as they are."""
    args, kwargs = call
    keep = {id(x) for _, x in donated(impl, call)}
    cast = lambda x: (x.detach().to(dtype).requires_grad_(x.requires_grad)  # noqa: E731
                      if isinstance(x, torch.Tensor) and x.is_floating_point() and id(x) not in keep else x)
    return tuple(cast(x) for x in args), {key: cast(x) for key, x in kwargs.items()}


def _under_autocast(fn, dtype):
    def call(*args, **kwargs):
        with torch.autocast("cpu", dtype=dtype):
            return fn(*args, **kwargs)
    return call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("contract,impl", [pytest.param(c, impl, id=f"{c.name}-{impl.name}")
                                           for c in CONTRACTS for impl in c.implementations])
def test_autocast_policy(contract, impl, dtype):
    lower = contract.name in LOWER_PRECISION_FAMILIES
    if lower:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(impl.op.name(), "AutocastCPU")
    call = contract.samples[0].make()
    got = forward_backward(_under_autocast(impl, dtype), fresh_copy(call))
    if not lower:  # autocast falls through: the op runs in its inputs' dtypes
        assert_all_equal(got, forward_backward(impl, call), "under autocast against without")
        return
    assert any(x.dtype == torch.float32 for x in all_tensors(call)), "an fp32 input for autocast to cast"
    want = forward_backward(impl, _autocast_cast(impl, call, dtype))
    results = len(got) - len(leaves(call))  # got: the results, then the leaves' gradients
    # Outputs as the low-precision call's; gradients reach the fp32 leaves through the casts, exactly.
    assert_all_equal(got, [w.to(g.dtype) for g, w in zip(got, want)], "under autocast against cast inputs")
    assert all(g.dtype == x.dtype for g, x in zip(got[results:], leaves(call)))
    if impl is contract.kernel and dtype == torch.bfloat16:  # compiled for bf16 only: seconds a compile
        compiled = torch.compile(_under_autocast(impl, dtype), fullgraph=True)
        args, kwargs = _detached(fresh_copy(call))
        assert_all_equal(outputs(compiled(*args, **kwargs)), got[:results], "compiled under autocast against eager")


# ---- torch.vmap and torch.func (design.md, "torch.vmap and torch.func") -------------------------

def _batch_of_two(call):
    """The call's positional tensors and a second sample's (floating tensors halved, the others
    repeated), stacked on a new dim 0; and the kwargs, shared by both samples."""
    args, kwargs = _detached(call)
    batched = tuple(torch.stack([x, x * 0.5 if x.is_floating_point() else x]) if isinstance(x, torch.Tensor) else x
                    for x in args)
    return batched, kwargs


def _sample(batched, b):
    """Sample b of a batch: what a loop over the batch passes (views of the stacked tensors)."""
    return tuple(x[b] if isinstance(x, torch.Tensor) else x for x in batched)


def _vmapped(impl, batched, kwargs):
    in_dims = tuple(0 if isinstance(x, torch.Tensor) else None for x in batched)
    return torch.vmap(lambda *a: impl(*a, **kwargs), in_dims=in_dims)(*batched)


@pytest.mark.parametrize("contract,impl", [pytest.param(c, impl, id=f"{c.name}-{impl.name}")
                                           for c in CONTRACTS for impl in c.implementations])
def test_vmap_matches_per_sample_calls(contract, impl):
    call = contract.samples[0].make()
    batched, kwargs = _batch_of_two(call)
    if donated(impl, call):
        with pytest.raises(RuntimeError, match=rf"{impl.op.name()}: torch.vmap is not supported: the op writes "
                                                 rf"{' and '.join(impl.donated_args)} in place"):
            _vmapped(impl, batched, kwargs)
        return
    # Our rule, not PyTorch's fallback (which prints a warning asking for a PyTorch issue).
    assert torch._C._dispatch_has_kernel_for_dispatch_key(impl.op.name(), "FuncTorchBatched")
    got = outputs(_vmapped(impl, batched, kwargs))
    want = [torch.stack(pair) for pair in zip(*(outputs(impl(*_sample(batched, b), **kwargs)) for b in (0, 1)))]
    # One call per sample (a reference of ATen ops too: the op's own rule comes before its
    # decomposition): the same bits; the kernel compiled too.
    assert_all_equal(got, want, "vmap against per-sample calls")
    if impl is contract.kernel:
        compiled = torch.compile(lambda *a: _vmapped(impl, a, kwargs), fullgraph=True)
        assert_all_equal(outputs(compiled(*batched)), want, "compiled vmap against per-sample calls")


@pytest.mark.parametrize("contract", [pytest.param(c, id=c.name) for c in CONTRACTS if not c.kernel.donated_args])
def test_vmap_over_one_argument_at_dim_1(contract):
    """The first tensor batched along its dim 1, every other argument shared by the samples."""
    args, kwargs = _detached(contract.samples[0].make())
    first = next(i for i, x in enumerate(args) if isinstance(x, torch.Tensor))
    x = args[first]
    batch = torch.stack([x, x * 0.5 if x.is_floating_point() else x], 1)
    in_dims = tuple(1 if i == first else None for i in range(len(args)))
    call = lambda *a: contract.kernel(*a, **kwargs)  # noqa: E731
    got = outputs(torch.vmap(call, in_dims=in_dims)(*args[:first], batch, *args[first + 1:]))
    per_sample = [outputs(call(*args[:first], batch.select(1, b), *args[first + 1:])) for b in (0, 1)]
    assert_all_equal(got, [torch.stack(pair) for pair in zip(*per_sample)], "vmap at dim 1 against per-sample calls")
    # An empty batch: outputs of the samples' shapes and dtypes, with a batch dimension of 0.
    empty = outputs(torch.vmap(call, in_dims=in_dims)(*args[:first], batch[:, :0], *args[first + 1:]))
    assert [(e.shape, e.dtype) for e in empty] == [((0, *p.shape), p.dtype) for p in per_sample[0]]


def _grad_sample(contract):
    """The first sample with a positional leaf, or None when the op has no gradients."""
    return next((s for s in contract.samples if any(x.requires_grad for x in s.make()[0]
                                                    if isinstance(x, torch.Tensor))), None)


def _grad_contracts():
    return [pytest.param(c, id=c.name) for c in CONTRACTS if _grad_sample(c) is not None]


def _leaf_positions(call):
    return [i for i, x in enumerate(call[0]) if isinstance(x, torch.Tensor) and x.requires_grad]


@pytest.mark.parametrize("contract", _grad_contracts())
def test_vmap_then_backward_matches_per_sample_gradients(contract):
    call = _grad_sample(contract).make()
    positions = _leaf_positions(call)
    batched, kwargs = _batch_of_two(call)
    batched = tuple(x.requires_grad_(True) if i in positions else x for i, x in enumerate(batched))
    first = first_output(_vmapped(contract.kernel, batched, kwargs))
    weight = torch.linspace(-1, 1, first.numel(), dtype=torch.float64).view(first.shape).to(first.dtype)
    got = torch.autograd.grad((first * weight).sum(), [batched[i] for i in positions])
    per_sample = []
    for b in (0, 1):  # the same views of the batch, as leaves of their own
        sample = tuple(x.detach().requires_grad_(True) if i in positions else x
                       for i, x in enumerate(_sample(batched, b)))
        out = first_output(contract.kernel(*sample, **kwargs))
        per_sample.append(torch.autograd.grad((out * weight[b]).sum(), [sample[i] for i in positions]))
    assert_all_equal(list(got), [torch.stack(pair) for pair in zip(*per_sample)], "gradients through vmap")


#: The families whose kernel refuses torch.func and forward mode: their reference is a C++
#: autograd Function too, so it cannot stand in (design.md, "torch.vmap and torch.func"). The spec
#: this test pins, not derived from the registrations.
NO_REFERENCE_UNDER_TRANSFORMS = {"ragged_dot"}


def _transforms(fn, x):
    """torch.func's differentiating transforms of fn (a scalar function of x), and forward mode."""
    def forward_ad():
        with torch.autograd.forward_ad.dual_level():
            out = fn(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)))
            return torch.autograd.forward_ad.unpack_dual(out).tangent
    return {"grad": lambda: torch.func.grad(fn)(x), "vjp": lambda: torch.func.vjp(fn, x)[1](torch.ones(())),
            "jacrev": lambda: torch.func.jacrev(fn)(x), "jvp": lambda: torch.func.jvp(fn, (x,), (torch.ones_like(x),)),
            "forward_ad": forward_ad}


@pytest.mark.parametrize("contract", _grad_contracts())
def test_torch_func_and_forward_mode_run_the_reference(contract):
    """Under torch.func's grad, vjp, jacrev and jvp, and in forward mode, the kernel runs its
    reference: the reference's results bit for bit, within tolerance of the kernel's own
    gradient; where the reference cannot stand in, an error naming the op."""
    call = _grad_sample(contract).make()
    args, kwargs = _detached(call)
    position = _leaf_positions(call)[0]

    def loss(impl):
        return lambda x: first_output(impl(*args[:position], x, *args[position + 1:], **kwargs)).float().sum()

    x = args[position]
    if contract.name in NO_REFERENCE_UNDER_TRANSFORMS:
        for name, transform in _transforms(loss(contract.kernel), x).items():
            message = (r"jvp is not implemented for the c\+\+ API" if name == "forward_ad" else
                       rf"{contract.kernel.op.name()}: torch.func transforms that differentiate .* cannot run this op")
            with pytest.raises(RuntimeError, match=message):
                transform()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-op warning that the reference runs
        got = {name: t() for name, t in _transforms(loss(contract.kernel), x).items()}
    want = {name: t() for name, t in _transforms(loss(contract.reference), x).items()}
    for name in got:
        assert_all_equal(outputs(got[name]), outputs(want[name]), f"{name} of the kernel against the reference's")
    leaf = x.clone().requires_grad_(True)
    (autograd,) = torch.autograd.grad(loss(contract.kernel)(leaf), [leaf])
    assert_all_close([got["grad"]], [autograd], contract.tolerance, "torch.func.grad against the kernel's backward",
                     is_low_precision(call))
    # Per-sample gradients: vmap over grad, against grad per sample.
    batch = torch.stack([x, x * 0.5])
    per_sample = torch.vmap(torch.func.grad(loss(contract.kernel)))(batch)
    assert_all_close([per_sample], [torch.stack([torch.func.grad(loss(contract.kernel))(b) for b in batch])],
                     contract.tolerance, "vmap of grad against grad per sample", is_low_precision(call))
    # functionalize does not differentiate: the kernel itself runs.
    assert torch.equal(torch.func.functionalize(loss(contract.kernel))(x), loss(contract.kernel)(x))


@pytest.mark.parametrize("contract", _grad_contracts())
def test_compiled_autograd_matches_eager(contract):
    """Compiled autograd captures a backward with the op's C++ autograd Function in it (run in
    eager inside the captured graph) and gives eager's bits."""
    call = _grad_sample(contract).make()
    want = forward_backward(contract.kernel, call)
    counters.clear()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        got = forward_backward(contract.kernel, call)
    assert counters["compiled_autograd"]["captures"] == 1
    assert_all_equal(got, want, "compiled autograd against eager")


# ---- configs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("contract,sample", _kernel_samples())
def test_no_config_is_the_heuristic_config(contract, sample):
    kernel = contract.kernel
    args, kwargs = sample.make()
    kwargs.pop("configs", None)
    call = (args, kwargs)
    assert tokamax_torch.get_configs(contract.reference, *args, **kwargs) == (None, None)
    configs = tokamax_torch.get_configs(kernel, *args, **kwargs)
    heuristic = kernel.split_configs(configs)
    # Observed: each kernel call of every product that ran recorded the heuristic's config.
    with record_configs() as records:
        plain = forward_backward(kernel, call)
    assert_ran_configs(records, kernel, ran_products(kernel, call), heuristic, given=False)
    with record_configs() as records:
        explicit = forward_backward(kernel, with_configs(call, configs))
    assert_ran_configs(records, kernel, ran_products(kernel, call), heuristic, given=True)
    assert_all_equal(plain, explicit, "configs=None against the heuristic configs")
    # Under torch.compile the config dataclasses are constants (no graph break), the op opaque:
    # the same configs run, and the same bits as eager, with or without configs.
    args, kwargs = _detached(call)
    plain = torch.compile(lambda *a: kernel(*a, **kwargs), fullgraph=True)
    given = torch.compile(lambda *a: kernel(*a, configs=configs, **kwargs), fullgraph=True)
    n = len(explicit) - len(leaves(call))
    for fn, was_given, what in ((plain, False, "compiled, no configs"), (given, True, "compiled, configs")):
        with record_configs() as records:
            out = list(torch.utils._pytree.tree_leaves(fn(*args)))[:n]
        assert_ran_configs(records, kernel, {"forward"}, heuristic, given=was_given)
        assert_all_equal(out, explicit[:n], what)


@pytest.mark.parametrize("contract,product", _products())
def test_config_space_starts_with_the_heuristic_config(contract, product):
    kernel = contract.kernel
    args, kwargs = contract.config_samples[product].make()
    space = kernel.config_space(*args, product=product, **kwargs)
    assert len(space) > 1 and all(isinstance(c, kernel.config_cls) for c in space)
    assert space[0] == kernel.split_configs(tokamax_torch.get_configs(kernel, *args, **kwargs))[product]
    with pytest.raises(ValueError, match="product must be one of"):
        kernel.config_space(*args, product="no such product", **kwargs)


@pytest.mark.parametrize("contract,product", _products())
def test_explicit_configs_are_honoured(contract, product):
    kernel = contract.kernel
    call = contract.config_samples[product].make()
    if product == "forward":
        call = _detached(call)
    args, kwargs = call
    heuristic = kernel.split_configs(tokamax_torch.get_configs(kernel, *args, **kwargs))
    ran = ran_products(kernel, call)
    assert product in ran, f"config_samples[{product!r}] does not run the {product} product"
    want = forward_backward(contract.reference, call)
    space = kernel.config_space(*args, product=product, **kwargs)
    for i, config in enumerate(space):
        configs = kernel.assemble_configs({**heuristic, product: config})
        # Observed: the product's calls ran `config`, every other product its heuristic config.
        with record_configs() as records:
            got = forward_backward(kernel, with_configs(call, configs))
        assert_ran_configs(records, kernel, ran, {**heuristic, product: config}, given=True)
        if i < 2:
            with record_configs() as as_lists:
                again = forward_backward(kernel, with_configs(call, configs_as_lists(configs)))
            assert as_lists == records, f"{config} as a Config and as a list"
            assert_all_equal(again, got, f"{config} as a Config and as a list")
        assert_all_close(got, want, contract.tolerance, f"{config} against the reference")


@pytest.mark.parametrize("contract,impl,message,configs", _invalid_configs())
def test_invalid_configs_rejected(contract, impl, message, configs):
    call = contract.samples[0].make()
    if len(contract.kernel.product_specs) > 1:  # an op with a backward product
        assert leaves(call), "the first sample has gradients: backward configs are checked at the forward call"
    args, kwargs = with_configs(call, configs)
    with pytest.raises(RuntimeError, match=message):
        impl(*args, **kwargs)
    if impl is contract.kernel:
        compiled = torch.compile(lambda *a: impl(*a, **kwargs), fullgraph=True)
        with pytest.raises(Exception, match=message):
            compiled(*args)


# ---- bad inputs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("contract,impl,bad", _bad_inputs())
def test_bad_input_raises_before_compute(contract, impl, bad):
    # A donated buffer is not written by a call that fails (no partial update).
    before = [(name, x.clone()) for name, x in _donated_if_bindable(impl, (bad.args, bad.kwargs))]
    with pytest.raises(RuntimeError, match=bad.message):
        impl(*bad.args, **bad.kwargs)
    for (name, old), (_, now) in zip(before, _donated_if_bindable(impl, (bad.args, bad.kwargs))):
        assert _same_bits(old, now), f"{name} was written by a call that failed"


def _same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _donated_if_bindable(impl, call):
    if not impl.donated_args:
        return []
    return [(name, x) for name, x in donated(impl, call) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("contract,impl,bad", _bad_inputs())
def test_bad_input_raises_under_compile(contract, impl, bad):
    compiled = torch.compile(lambda *a: impl(*a, **bad.kwargs), fullgraph=True)
    with pytest.raises(Exception, match=bad.message):
        compiled(*bad.args)


# ---- determinism --------------------------------------------------------------------------------

@pytest.mark.parametrize("num_threads", THREAD_COUNTS, ids=lambda n: f"{n}threads", indirect=True)
@pytest.mark.parametrize("contract,sample", _determinism_samples())
def test_kernel_bitwise_deterministic_across_runs_and_threads(contract, sample, num_threads):
    # Only the kernels promise this: ATen's (the reference's) summation order may follow the
    # thread count.
    call = sample.make()
    first = forward_backward(contract.kernel, call)
    again = forward_backward(contract.kernel, call)
    with threads(1):
        want = forward_backward(contract.kernel, call)
    assert_all_equal(first, want, f"{num_threads} threads against 1")
    assert_all_equal(again, first, "a second run")


# ---- buffer donation: for every op that declares donated_args -------------------------------------

DONATING = [c for c in CONTRACTS if c.kernel.donated_args]
RSS_BYTES = 2 << 30  # the donated buffer of the peak-memory proof
RSS_FRACTION = 0.05  # the most a call may grow peak RSS by, as a fraction of the donated bytes


def _donating_samples(compiled=False):
    return [p for p in _impl_samples(compiled=compiled, contracts=DONATING)]


@pytest.mark.parametrize("contract,impl,sample", _donating_samples())
def test_donated_result_is_the_input(contract, impl, sample):
    call = sample.make()
    out = impl.donated_outputs(impl(*call[0], **call[1]))
    for (name, x), o in zip(donated(impl, call), out):
        assert o is x or (o.data_ptr() == x.data_ptr() and o.untyped_storage().data_ptr()
                          == x.untyped_storage().data_ptr()), f"{name}: the result is not the donated buffer"


def _compiled_against_eager(impl, call, compiled_fn):
    """Runs `impl` eager and `compiled_fn` on deep copies of `call`; every output and every
    argument afterwards (the donated buffers' state included) equal bit for bit, and the
    compiled results are the compiled call's own donated buffers."""
    eager_call, compiled_call = fresh_copy(call), fresh_copy(call)
    eager = outputs(impl(*eager_call[0], **eager_call[1]))
    result = compiled_fn(*compiled_call[0], **compiled_call[1])
    got = outputs(result)
    assert_all_equal(got, eager, "compiled against eager")
    assert_all_equal(all_tensors(compiled_call), all_tensors(eager_call), "arguments after the call")
    for (name, x), o in zip(donated(impl, compiled_call), impl.donated_outputs(result)):
        assert o.data_ptr() == x.data_ptr(), f"{name}: the compiled result is not the donated buffer"
    return compiled_call


@pytest.mark.parametrize("contract,impl,sample", _donating_samples(compiled=True))
def test_donation_compiled_matches_eager_bitwise_without_copies(contract, impl, sample):
    call = sample.make()
    compiled = torch.compile(lambda *a, **k: impl(*a, **k), fullgraph=True)
    codes = []

    def run(*args, **kwargs):  # once: a donating op's second run would see its first run's writes
        out, code = run_and_get_code(compiled, *args, **kwargs)
        codes.extend(code)
        return out

    _compiled_against_eager(impl, call, run)
    buffers = [x for _, x in donated(impl, call)]
    assert codes and not copies_in_code(codes, buffers), copies_in_code(codes, buffers)


@pytest.mark.parametrize("contract,impl,sample", _donating_samples(compiled=True))
def test_donation_reduce_overhead_matches_eager_bitwise(contract, impl, sample):
    # mode="reduce-overhead" records CUDA graphs where the device has them (Inductor skips them
    # for CPU tensors): the mutation of the donated buffers must survive that path too.
    compiled = torch.compile(lambda *a, **k: impl(*a, **k), fullgraph=True, mode="reduce-overhead")
    _compiled_against_eager(impl, sample.make(), compiled)


@pytest.mark.parametrize("contract,impl,dynamic", _impl_dynamic(compiled=True, contracts=DONATING))
def test_donation_dynamic_matches_eager_bitwise_without_copies(contract, impl, dynamic):
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda *a, **k: impl(*a, **k), backend=counter, fullgraph=True, dynamic=True)
    for sizes in dynamic.sizes:
        call = dynamic.make(**sizes)
        _compiled_against_eager(impl, call, compiled)
    assert counter.frame_count == 1, "one graph for every size"
    torch._dynamo.reset()
    call = dynamic.make(**dynamic.sizes[0])
    _, codes = run_and_get_code(torch.compile(lambda *a, **k: impl(*a, **k), fullgraph=True, dynamic=True),
                                *fresh_copy(call)[0], **call[1])
    assert codes and not copies_in_code(codes, []), copies_in_code(codes, [])


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("contract", DONATING, ids=lambda c: c.name)
def test_donation_peak_rss(contract, mode):
    assert contract.donation_call is not None, f"{contract.name} donates: its CONTRACT needs a donation_call"
    result = donation_peak_rss(contract.name, mode, RSS_BYTES)
    print(f"{contract.name} {mode}: peak RSS +{result['growth'] / 2**20:.1f} MiB for a "
          f"{result['donated_bytes'] / 2**30:.2f} GiB donated buffer (peak reset: {result['reset']})")
    assert result["same_storage"], "the result is not the donated buffer"
    assert result["donated_bytes"] >= RSS_BYTES * 0.9, result
    assert result["growth"] < RSS_FRACTION * result["donated_bytes"], result
