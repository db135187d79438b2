"""Checks that need a fresh process each: what happens on the first parallel call of a process.

oneMKL's VML, which ATen runs float exp/log/tanh/... on, picks each function's kernel on its first
call; a first call made on several threads at once could run a low-accuracy kernel on one
thread's chunk (pytorch/pytorch#188792). The library settles those choices when it loads
(csrc/torch/library.cc). TOKAMAX_FRESH_PROCESS_RUNS sets how many processes each test starts
(the race hit about 1 process in 30-70 on a 2-vCPU VM; 200 were run for the fix)."""

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
RUNS = int(os.environ.get("TOKAMAX_FRESH_PROCESS_RUNS", "12"))
# Two threads at least: the race needs a parallel first call.
ENV = {**os.environ, "OMP_NUM_THREADS": str(max(2, int(os.environ.get("OMP_NUM_THREADS", "2"))))}


def run_processes(args: list[str]) -> list[subprocess.CompletedProcess]:
    return [subprocess.run([sys.executable, *args, str(seed)], capture_output=True, text=True, env=ENV, cwd=HERE)
            for seed in range(RUNS)]


def test_reference_after_kernel_backward_in_fresh_processes():
    results = run_processes([str(HERE / "fresh_process" / "attention_after_backward.py")])
    failed = [(seed, r.stdout.strip(), r.stderr[-500:]) for seed, r in enumerate(results) if r.returncode != 0]
    assert not failed, f"{len(failed)} of {RUNS} fresh processes were wrong (seed, error, stderr): {failed}"


FIRST_PARALLEL_EXP = """
import sys, torch, tokamax_torch
torch.manual_seed(int(sys.argv[1]))
torch.bmm(torch.randn(2, 130, 64), torch.randn(2, 64, 130))
x = torch.linspace(-0.5, -0.2, 2 * 33280)  # around -ln(2)/2, where the low-accuracy kernel is off most
first, second = torch.exp(x), torch.exp(x)
sys.exit(0 if torch.equal(first, second) else 1)
"""


def test_first_parallel_exp_after_import_is_the_settled_kernel():
    results = run_processes(["-c", FIRST_PARALLEL_EXP])
    failed = [seed for seed, r in enumerate(results) if r.returncode != 0]
    assert not failed, f"the first parallel exp differed from the second in processes {failed}: {[r.stderr[-300:] for r in results if r.returncode]}"
