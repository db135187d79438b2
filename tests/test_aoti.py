"""AOTInductor, as a deployment without Python op code would use it: every op's kernel, exported
with its dynamic dims, compiled by `aoti_compile_and_package` into one package, then loaded and
run in a fresh process that loads only the op library (`torch.ops.load_library` of
tokamax_torch/_C*.so; the tokamax_torch package is never imported there), at sizes other than
the exported ones. Results match eager; the donated buffers are written in place and returned
(the same storage), as in eager. One package for every op: AOTInductor compiles for tens of
seconds."""

import pathlib
import subprocess
import sys

import torch

import tokamax_torch
from contract import assert_all_close, assert_all_equal, is_low_precision, outputs
from test_op_contract import COMPILE_TOLERANCE, CONTRACTS, _detached

LIBRARY = next(pathlib.Path(tokamax_torch.__file__).parent.glob("_C*.so"))

RUN_PACKAGE = """
import sys, torch
torch.ops.load_library(sys.argv[1])
package = torch._inductor.aoti_load_package(sys.argv[2])
inputs = torch.load(sys.argv[3])
results = package(*inputs)
aliases = [[i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and r.data_ptr() == x.data_ptr()]
           for r in results]
assert "tokamax_torch" not in sys.modules, "the package was run without the Python op code"
torch.save({"results": list(results), "inputs": inputs, "aliases": aliases}, sys.argv[4])
"""


def _tensors(out) -> list[torch.Tensor]:
    """Every tensor an op returned, nested tuples flattened (a donating op returns its results and
    the donated buffers)."""
    flat = []
    for x in outputs(out):
        flat.extend(_tensors(x) if isinstance(x, (tuple, list)) else [x])
    return flat


class EveryOp(torch.nn.Module):
    """Each op's kernel on its own slice of the positional inputs, with its keyword arguments."""

    def __init__(self, calls):
        super().__init__()
        self.kernels = [contract.kernel for contract, _ in calls]
        self.kwargs = [call[1] for _, call in calls]
        self.arities = [len(call[0]) for _, call in calls]

    def forward(self, *xs):
        results, start = [], 0
        for kernel, kwargs, arity in zip(self.kernels, self.kwargs, self.arities):
            results.extend(_tensors(kernel(*xs[start:start + arity], **kwargs)))
            start += arity
        return tuple(results)


def _calls(size_index: int):
    return [(contract, _detached(contract.dynamic[0].make(**contract.dynamic[0].sizes[size_index])))
            for contract in CONTRACTS]


def test_every_kernel_runs_from_an_aoti_package_without_the_python_package(tmp_path):
    exported_calls = _calls(0)
    spec = []
    for contract, _ in exported_calls:
        dynamic = contract.dynamic[0]
        # Dim names are global to the export: each op's own, prefixed with the op.
        dims = {name: torch.export.Dim(f"{contract.name}_{name}", min=lo, max=hi)
                for name, (lo, hi) in dynamic.dims.items()}
        spec.extend(dynamic.dynamic_shapes(dims))
    module = EveryOp(exported_calls)
    exported = torch.export.export(module, tuple(x for _, call in exported_calls for x in call[0]),
                                   dynamic_shapes=(tuple(spec),))
    package = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "every_op.pt2"))

    # Other sizes than the exported ones; the package runs on copies, eager on the originals.
    calls = _calls(1)
    for (contract, call), (_, exported_call) in zip(calls, exported_calls):
        assert call[1] == exported_call[1], f"{contract.name}: the keyword arguments are the exported ones"
        constants = [(x, y) for x, y in zip(call[0], exported_call[0]) if not isinstance(x, torch.Tensor)]
        assert all(x == y for x, y in constants), f"{contract.name}: positional non-tensors are the exported ones"
    inputs = [x for _, call in calls for x in call[0]]
    copy = lambda x: x.clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    torch.save([copy(x) for x in inputs], tmp_path / "inputs.pt")
    want_per_op = [_tensors(contract.kernel(*call[0], **call[1])) for contract, call in calls]
    want = [x for results in want_per_op for x in results]
    want_aliases = [[i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and r.data_ptr() == x.data_ptr()]
                    for r in want]
    assert any(want_aliases), "some op donates a buffer: the aliasing check has something to check"

    run = subprocess.run([sys.executable, "-c", RUN_PACKAGE, str(LIBRARY), package, str(tmp_path / "inputs.pt"),
                          str(tmp_path / "outputs.pt")], capture_output=True, text=True)
    assert run.returncode == 0, f"the package failed in a fresh process:\n{run.stderr[-3000:]}"
    got = torch.load(tmp_path / "outputs.pt")

    assert got["aliases"] == want_aliases, "the donated buffers are the returned ones, as in eager"
    assert len(got["results"]) == len(want)
    start = 0
    for (contract, call), results in zip(calls, want_per_op):
        assert_all_close(got["results"][start:start + len(results)], results, COMPILE_TOLERANCE,
                         f"{contract.name}: AOTInductor package against eager", low_precision=is_low_precision(call))
        start += len(results)
    # The buffers the ops wrote in place hold what eager wrote (copies of the same rows: equal bits).
    tensors = lambda xs: [x for x in xs if isinstance(x, torch.Tensor)]  # noqa: E731
    assert_all_equal(tensors(got["inputs"]), tensors(inputs), "inputs after the call, donated buffers included")
