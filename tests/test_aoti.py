"""AOTInductor, as a deployment without Python op code would use it: every op's kernel, exported
with its dynamic dims, compiled by `aoti_compile_and_package` into one package, then run at sizes
other than the exported ones by (1) a fresh Python process that loads only the op library
(`torch.ops.load_library` of tokamax_torch/_C*.so; the tokamax_torch package is never imported
there) and (2) a C++ program built against libtorch that dlopens the library and runs the package
with `AOTIModelPackageLoader` (tests/aoti_runner/runner.cc). Results match eager; the donated
buffers are written in place and returned (the same storage), as in eager. One package for every
op: AOTInductor compiles for tens of seconds."""

import pathlib
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.utils.cpp_extension

import tokamax_torch
from contract import assert_all_close, assert_all_equal, is_low_precision, outputs
from test_op_contract import COMPILE_TOLERANCE, CONTRACTS, _detached

LIBRARY = next(pathlib.Path(tokamax_torch.__file__).parent.glob("_C*.so"))
RUNNER_SOURCE = pathlib.Path(__file__).resolve().parent / "aoti_runner" / "runner.cc"

# The package's inputs are the calls' tensors: the int arguments (moe_permute's and topk's
# counts) are constants of the exported program.
RUN_PACKAGE = """
import sys, torch
torch.ops.load_library(sys.argv[1])
package = torch._inductor.aoti_load_package(sys.argv[2])
inputs = torch.load(sys.argv[3])
results = package(*inputs)
aliases = [max([i for i, x in enumerate(inputs) if r.data_ptr() == x.data_ptr()], default=-1) for r in results]
assert "tokamax_torch" not in sys.modules, "the package was run without the Python op code"
torch.save([list(results), inputs, torch.tensor(aliases, dtype=torch.int64)], sys.argv[4])
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


def _aliases(results, inputs) -> torch.Tensor:
    """For each result, the index of the input it shares its data with, or -1."""
    return torch.tensor([max([i for i, x in enumerate(inputs) if r.data_ptr() == x.data_ptr()], default=-1)
                         for r in results], dtype=torch.int64)


@pytest.fixture(scope="module")
def every_op(tmp_path_factory):
    """The package, the inputs it runs on (saved: tensors only), and eager's results on them."""
    directory = tmp_path_factory.mktemp("aoti")
    exported_calls = _calls(0)
    spec = []
    for contract, _ in exported_calls:
        dynamic = contract.dynamic[0]
        # Dim names are global to the export: each op's own, prefixed with the op.
        dims = {name: torch.export.Dim(f"{contract.name}_{name}", min=lo, max=hi)
                for name, (lo, hi) in dynamic.dims.items()}
        spec.extend(dynamic.dynamic_shapes(dims))
    exported = torch.export.export(EveryOp(exported_calls), tuple(x for _, call in exported_calls for x in call[0]),
                                   dynamic_shapes=(tuple(spec),))
    package = torch._inductor.aoti_compile_and_package(exported, package_path=str(directory / "every_op.pt2"))

    # Other sizes than the exported ones; the package runs on copies, eager on the originals.
    calls = _calls(1)
    for (contract, call), (_, exported_call) in zip(calls, exported_calls):
        assert call[1] == exported_call[1], f"{contract.name}: the keyword arguments are the exported ones"
        constants = [(x, y) for x, y in zip(call[0], exported_call[0]) if not isinstance(x, torch.Tensor)]
        assert all(x == y for x, y in constants), f"{contract.name}: positional non-tensors are the exported ones"
    inputs = [x for _, call in calls for x in call[0] if isinstance(x, torch.Tensor)]
    torch.save([x.clone() for x in inputs], directory / "inputs.pt")
    want_per_op = [_tensors(contract.kernel(*call[0], **call[1])) for contract, call in calls]
    want = [x for results in want_per_op for x in results]
    want_aliases = _aliases(want, inputs)
    assert (want_aliases >= 0).any(), "some op donates a buffer: the aliasing check has something to check"
    return types.SimpleNamespace(directory=directory, package=package, calls=calls, inputs=inputs,
                                 want_per_op=want_per_op, want_aliases=want_aliases)


def _check(every_op, saved_path):
    results, inputs_after, aliases = torch.load(saved_path, weights_only=False)  # our own file
    assert torch.equal(aliases, every_op.want_aliases), "the donated buffers are the returned ones, as in eager"
    assert len(results) == sum(len(r) for r in every_op.want_per_op)
    start = 0
    for (contract, call), want in zip(every_op.calls, every_op.want_per_op):
        assert_all_close(results[start:start + len(want)], want, COMPILE_TOLERANCE,
                         f"{contract.name}: AOTInductor package against eager", low_precision=is_low_precision(call))
        start += len(want)
    # The buffers the ops wrote in place hold what eager wrote (copies of the same rows: equal bits).
    assert_all_equal(inputs_after, every_op.inputs, "inputs after the call, donated buffers included")


def test_package_runs_in_python_without_the_python_package(every_op):
    saved = every_op.directory / "python_outputs.pt"
    run = subprocess.run([sys.executable, "-c", RUN_PACKAGE, str(LIBRARY), every_op.package,
                          str(every_op.directory / "inputs.pt"), str(saved)], capture_output=True, text=True)
    assert run.returncode == 0, f"the package failed in a fresh process:\n{run.stderr[-3000:]}"
    _check(every_op, saved)


def test_package_runs_from_a_cpp_program(every_op):
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler, "a C++ compiler (the project's build needs one)"
    runner = every_op.directory / "runner"
    build = subprocess.run(
        [compiler, "-O1", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
         *[f"-I{p}" for p in torch.utils.cpp_extension.include_paths()], str(RUNNER_SOURCE), "-o", str(runner),
         *[f"-L{p}" for p in torch.utils.cpp_extension.library_paths()],
         *[f"-Wl,-rpath,{p}" for p in torch.utils.cpp_extension.library_paths()],
         "-ltorch", "-ltorch_cpu", "-lc10", "-ldl"], capture_output=True, text=True)
    assert build.returncode == 0, f"building the runner failed:\n{build.stderr[-3000:]}"
    saved = every_op.directory / "cpp_outputs.pt"
    run = subprocess.run([str(runner), str(LIBRARY), every_op.package, str(every_op.directory / "inputs.pt"),
                          str(saved)], capture_output=True, text=True)
    assert run.returncode == 0, f"the C++ runner failed:\n{run.stderr[-3000:]}"
    _check(every_op, saved)
