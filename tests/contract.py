"""What every op family owes, checked the same way for each: the op contract of docs/design.md.

An op's test file declares an ``OpContract``: its two singletons, a few sample calls covering its
options (at least one with gradients), its bad inputs, its invalid configs, the problems on which
configs must change the kernel's bits, and how its sizes vary under dynamic shapes.
``tests/test_op_contract.py`` runs every check below for every declared op; the op's own file keeps
its float64-oracle numerics and its special cases.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
from typing import Any, Callable, Optional, Sequence

import torch

#: The thread counts the kernels promise the same bits at (32 oversubscribes a small machine:
#: slower, never different).
THREAD_COUNTS = (1, 2, 3, 8, 32)

Call = tuple[tuple, dict]  # positional and keyword arguments of one call of a singleton


@dataclasses.dataclass(frozen=True)
class Sample:
    """One call of an op: `make()` returns fresh (args, kwargs); leaves that require grad get
    gradients checked.

    Compiling is the slow part of the suite (seconds per graph, more for the reference, whose ATen
    ops Inductor fuses): `compile=False` leaves a sample out of the compiled-against-eager check,
    `reference=False` checks it on the kernel alone (a sample for a path only the kernel has).
    """

    id: str
    make: Callable[[], Call]
    compile: bool = True
    reference: bool = True


@dataclasses.dataclass(frozen=True)
class BadInput:
    """A call that must raise RuntimeError matching `message`, in eager and compiled code.

    kernel_only: a check of tensor values the reference does not make (it treats them as data).
    """

    message: str
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    kernel_only: bool = False


@dataclasses.dataclass(frozen=True)
class DynamicSizes:
    """An op's calls at varying sizes, for torch.compile(dynamic=True) and torch.export.

    make(**sizes) returns (args, kwargs); `sizes` holds three size dicts that no other dimension
    equals (duck sizing would merge them), the first also the one exported; `dims` gives each
    dynamic size's (min, max); `dynamic_shapes(dims)` the export spec of the positional args;
    the exported program also runs at `export_only_sizes` (sizes such as 1 that compile
    specializes on).
    """

    id: str
    make: Callable[..., Call]
    sizes: Sequence[dict]
    dims: dict
    dynamic_shapes: Callable[[dict], tuple]
    export_only_sizes: Sequence[dict] = ()


@dataclasses.dataclass(frozen=True)
class OpContract:
    name: str
    reference: Any
    kernel: Any
    samples: Sequence[Sample]
    bad_inputs: Callable[[], list[BadInput]]
    dynamic: Sequence[DynamicSizes]
    #: Calls large enough that the kernel splits them over threads, forward and backward.
    determinism_samples: Sequence[Sample]
    #: (message, configs): invalid configs, rejected at the forward call by both singletons.
    #: Empty for an op without configs (its kernel declares no products), as is config_samples.
    invalid_configs: Sequence[tuple[str, tuple]] = ()
    #: Per product, a call that runs that product and whose search space has more than one
    #: config; each config of the space is run on it and must be the one the kernel records.
    config_samples: dict[str, Sample] = dataclasses.field(default_factory=dict)
    #: rtol = atol between two runs of the same math in fp32 (compiled against eager, kernel
    #: against reference); the op file's oracle tests hold the real tolerances.
    tolerance: float = 1e-4
    #: For an op that donates inputs (``Op.donated_args``): donation_call(nbytes) makes a call
    #: whose donated buffers hold about `nbytes` bytes, every page touched, for the peak-memory
    #: proof (run in a fresh process). Required when the op donates.
    donation_call: Optional[Callable[[int], Call]] = None

    @property
    def implementations(self):
        return (self.reference, self.kernel)


# ---- helpers ------------------------------------------------------------------------------------

@contextlib.contextmanager
def threads(n: int):
    """Runs the block at n threads, then restores the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def leaves(call: Call) -> list[torch.Tensor]:
    """The tensors of a call that require grad, in argument order."""
    args, kwargs = call
    return [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.requires_grad]


def first_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def outputs(out) -> list[torch.Tensor]:
    """The tensors an op returned; an optional output left out (None, as topk's values) is skipped."""
    return [x for x in out if x is not None] if isinstance(out, (tuple, list)) else [out]


def forward_backward(fn, call: Call) -> list[torch.Tensor]:
    """fn's outputs and, where the call has leaves, the gradients of a fixed weighting (a ramp
    from -1 to 1) of the first output; fresh leaves each time, so calls never share .grad."""
    args, kwargs = call
    fresh = {id(x): x.detach().clone().requires_grad_(True) for x in leaves(call)}
    swap = lambda x: fresh.get(id(x), x) if isinstance(x, torch.Tensor) else x  # noqa: E731
    args = tuple(swap(x) for x in args)
    kwargs = {key: swap(x) for key, x in kwargs.items()}
    out = fn(*args, **kwargs)
    results = [x.detach() for x in outputs(out)]
    if fresh:
        first = first_output(out)
        weight = torch.linspace(-1, 1, first.numel(), dtype=torch.float64).view(first.shape).to(first.dtype)
        results += torch.autograd.grad((first * weight).sum(), list(fresh.values()))
    return results


def schema_args(impl, call: Call) -> tuple:
    """The arguments the singleton passes to its registered op for this call (for opcheck),
    recorded by a copy of the singleton whose `_op` (the op it calls) is a recorder."""
    captured = []
    recorder = copy.copy(impl)
    recorder._op = lambda *a: captured.append(a) or impl.op(*a)
    args, kwargs = call
    recorder(*args, **kwargs)
    assert len(captured) == 1, "a singleton calls its registered op once"
    return captured[0]


def assert_all_equal(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: result {i} is {g.dtype}{list(g.shape)}"
        assert torch.equal(g, w), f"{what}: result {i} differs in its bits"


LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_low_precision(call: Call) -> bool:
    args, kwargs = call
    return any(isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION for x in (*args, *kwargs.values()))


def assert_all_close(got, want, rtol: float, what: str, low_precision: bool = False) -> None:
    """rtol = atol; at least 2e-2 for bf16/fp16 results or inputs (fused code may keep fp32
    where eager rounds to bf16)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        rtol_i = max(rtol, 2e-2) if low_precision or g.dtype in LOW_PRECISION else rtol
        torch.testing.assert_close(g, w, rtol=rtol_i, atol=rtol_i, equal_nan=True,
                                   msg=lambda m: f"{what}: result {i}: {m}")


def with_configs(call: Call, configs) -> Call:
    args, kwargs = call
    return args, {**kwargs, "configs": configs}


def configs_as_lists(configs) -> tuple:
    return tuple(None if c is None else c.to_list() for c in configs)


def ran_products(kernel, call: Call) -> set[str]:
    """The products a forward_backward of `call` runs: the forward, and each gradient product
    whose inputs (``Product.wrt``) include one that requires grad."""
    args, kwargs = call
    bound = kernel.bind(*args, **{k: v for k, v in kwargs.items() if k != "configs"})
    needs_grad = {name for name, x in bound.arguments.items() if isinstance(x, torch.Tensor) and x.requires_grad}
    return {p.name for p in kernel.product_specs if not p.wrt or needs_grad & set(p.wrt)}


def assert_ran_configs(records, kernel, products: set[str], want: dict, given: bool) -> None:
    """`records` (``tokamax_torch._op.record_configs``) hold calls of exactly `products`, each having
    run ``want[product]``, the caller's config when `given`, the heuristic's otherwise."""
    ran = {r.product for r in records}
    assert all(r.family == kernel.family for r in records), f"records of other ops: {records}"
    assert ran == products, f"products run: {sorted(ran)}, expected {sorted(products)}"
    for r in records:
        expected = tuple(want[r.product].to_list())
        assert r.config == expected, f"{r.product} ran {r.config}, expected {expected}"
        assert r.given == given, f"{r.product}: given={r.given}, expected {given}"


# ---- buffer donation (docs/design.md, "Buffer donation") -----------------------------------------

def donated(impl, call: Call) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) of each argument `impl` donates in `call`, in declaration order."""
    args, kwargs = call
    bound = impl.bind(*args, **kwargs)
    return [(name, bound[name]) for name in impl.donated_args]


def fresh_copy(call: Call) -> Call:
    """A deep copy of a call: same values, strides and sharing between arguments, new storage."""
    return copy.deepcopy(call)


def all_tensors(call: Call) -> list[torch.Tensor]:
    args, kwargs = call
    return [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]


def copies_in_code(codes: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[str]:
    """The lines of Inductor output code that copy or clone, or allocate a buffer of a donated
    buffer's size (static shapes): what functionalization leaves when it fails to reinplace."""
    sizes = {tuple(b.shape) for b in buffers} | {(b.numel(),) for b in buffers}
    found = []
    for code in codes:
        for line in code.splitlines():
            text = line.strip()
            if text.startswith("#") or "rand_strided(" in text:  # comments; the benchmark harness's inputs
                continue
            if re.search(r"\bcopy_\b|\bclone\b|aten\.copy|copy_misaligned_inputs", text):
                found.append(text)
            for match in re.finditer(r"empty_strided\w*\(\(([^)]*)\)", text):
                shape = tuple(int(v) for v in match.group(1).replace(" ", "").split(",") if v.isdigit())
                if shape in sizes:
                    found.append(text)
    return found


_RSS_SCRIPT = r"""
import importlib, json, sys
import torch
sys.path.insert(0, sys.argv[1])
contract = importlib.import_module("test_" + sys.argv[2]).CONTRACT
mode, nbytes = sys.argv[3], int(sys.argv[4])
kernel = contract.kernel

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False

fn = kernel if mode == "eager" else torch.compile(lambda *a, **k: kernel(*a, **k), fullgraph=True, dynamic=True)
args, kwargs = contract.donation_call(1 << 20)
fn(*args, **kwargs)  # imports, compilation: before the measured call
args, kwargs = contract.donation_call(nbytes)
# Where the peak can be reset, a first call at this size takes any recompilation and the
# measured call is the second; otherwise the first is measured against the peak so far.
reset = reset_peak()
if reset:
    fn(*args, **kwargs)
    reset_peak()
before = status("VmRSS") if reset else status("VmHWM")
out = fn(*args, **kwargs)
after = status("VmHWM")
bound = kernel.bind(*args, **kwargs)
outs = kernel.donated_outputs(out)
same = all(o.data_ptr() == bound[n].data_ptr() for o, n in zip(outs, kernel.donated_args))
donated_bytes = sum(bound[n].nbytes for n in kernel.donated_args)
print(json.dumps({"growth": after - before, "donated_bytes": donated_bytes, "reset": reset, "same_storage": same}))
"""


def donation_peak_rss(family: str, mode: str, nbytes: int) -> dict:
    """Runs one call of `family`'s kernel (eager or compiled) whose donated buffers hold `nbytes`,
    in a fresh process, after a warm-up call and a first call at that size, and returns
    {"growth": peak RSS growth of the measured call in bytes, "donated_bytes", "same_storage"}."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, tests, family, mode, str(nbytes)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
