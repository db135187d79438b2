"""layer_norm / rms_norm benchmark: the tokamax kernel, eager PyTorch (F.layer_norm /
F.rms_norm) and torch.compile of the tokamax reference, side by side in one run (timed calls
alternating; the median), forward and forward+backward, with a scale (and an offset for
layer_norm). Bandwidth counts the bytes a single-pass kernel must move: forward x read + y
written (+ residual read + h written), backward x (or h) and dy read + dx written, scale once;
the ceiling is a 256 MiB tensor copy measured in the same run (read + write bytes). Writes
benchmarks/results/layer_norm.json.

    python benchmarks/layer_norm.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

import tokamax_torch  # noqa: E402
from tokamax_torch.ops import layer_norm as ln  # noqa: E402


def copy_bandwidth_gbps() -> tuple[float, float]:
    """Read+write GB/s of a 256 MiB copy into a preallocated tensor, and of a clone (the same
    into a fresh tensor: its page faults are what any op returning a new tensor pays)."""
    src, dst = torch.ones(2**26), torch.empty(2**26)
    copy = common.time_fn(lambda: dst.copy_(src), warmup=2, reps=7)
    clone = common.time_fn(lambda: src.clone(), warmup=2, reps=7)
    return tuple(2 * src.nbytes / (t["median_ms"] * 1e-3) / 1e9 for t in (copy, clone))


def case(rows, cols, dtype, subtract_mean, reps):
    x = torch.randn(rows, cols).to(dtype)
    scale = torch.randn(cols)
    offset = torch.randn(cols) if subtract_mean else None
    dy = torch.randn(rows, cols).to(dtype)
    e = x.element_size()
    fwd_bytes = 2 * rows * cols * e + cols * 4
    bwd_bytes = fwd_bytes + 3 * rows * cols * e

    def kernel(a, s, o):
        return ln.kernel(a, s, o, subtract_mean=subtract_mean, epsilon=1e-5)

    def eager(a, s, o):
        if subtract_mean:
            return F.layer_norm(a, (cols,), s.to(dtype), o.to(dtype), eps=1e-5)
        return F.rms_norm(a, (cols,), s.to(dtype), eps=1e-5)

    torch._dynamo.reset()  # a fresh cache per case: the lambda's code object is shared
    compiled = torch.compile(lambda a, s, o: ln.reference(a, s, o, subtract_mean=subtract_mean, epsilon=1e-5))
    impls = {"kernel": kernel, "eager": eager, "compiled reference": compiled}

    def fwd(fn):
        return lambda: fn(x, scale, offset)

    def fwd_bwd(fn):
        def run():
            a = x.detach().requires_grad_(True)
            s = scale.detach().requires_grad_(True)
            o = offset.detach().requires_grad_(True) if offset is not None else None
            fn(a, s, o).backward(dy)
        return run

    rows_out = []
    for label, make, nbytes in (("forward", fwd, fwd_bytes), ("forward+backward", fwd_bwd, bwd_bytes)):
        times = common.time_interleaved([make(f) for f in impls.values()], warmup=2, reps=reps)
        for name, t in zip(impls, times):
            rows_out.append({"pass": label, "impl": name, "median_ms": t["median_ms"], "min_ms": t["min_ms"],
                             "gbps": nbytes / (t["median_ms"] * 1e-3) / 1e9})
    return rows_out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [(8192, 4096), (32768, 1024)] if not args.quick else [(2048, 1024)]
    reps = 3 if args.quick else 7
    # The ceilings are measured before and after the cases and the higher kept (the conservative
    # ceiling): on a shared VM one measurement can land in a slow moment (Zen 4, 2026-12-06: a
    # start-of-run copy at 11.8 GB/s, 45 GB/s a few minutes later).
    copy, clone = copy_bandwidth_gbps()
    info = {"machine": common.machine(), "copy_gbps": copy, "clone_gbps": clone, "cases": []}
    print(f"{info['machine']['cpu']} ({info['machine']['device_kind']}), {info['machine']['threads']} threads, "
          f"read+write (start of run): copy {copy:.1f} GB/s, clone (fresh output) {clone:.1f} GB/s")
    rows_to_print = []
    for subtract_mean, op in ((True, "layer_norm"), (False, "rms_norm")):
        for rows, cols in shapes:
            for dtype in (torch.float32, torch.bfloat16):
                results = case(rows, cols, dtype, subtract_mean, reps)
                info["cases"].append({"op": op, "shape": [rows, cols], "dtype": str(dtype), "results": results})
                for label in ("forward", "forward+backward"):
                    r = {x["impl"]: x for x in results if x["pass"] == label}
                    rows_to_print.append((op, rows, cols, dtype, label, r["kernel"], r["eager"], r["compiled reference"]))
                    print(f"  {op} {rows}x{cols} {str(dtype)[6:]} {label}: kernel {r['kernel']['median_ms']:.2f} ms "
                          f"({r['kernel']['gbps']:.1f} GB/s)", flush=True)
    copy_end, clone_end = copy_bandwidth_gbps()
    copy, clone = max(copy, copy_end), max(clone, clone_end)
    info.update(copy_gbps=copy, clone_gbps=clone, copy_gbps_end=copy_end, clone_gbps_end=clone_end)
    print(f"read+write (end of run): copy {copy_end:.1f} GB/s, clone {clone_end:.1f} GB/s; the table uses the higher: "
          f"copy {copy:.1f}, clone {clone:.1f} GB/s")
    print("| op | shape | dtype | pass | kernel ms | eager ms | compiled ref ms | kernel GB/s (% copy, % clone) | "
          "vs eager | vs compiled |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for op, rows, cols, dtype, label, k, e, c in rows_to_print:
        print(f"| {op} | {rows}x{cols} | {str(dtype)[6:]} | {label} | {k['median_ms']:.2f} | "
              f"{e['median_ms']:.2f} | {c['median_ms']:.2f} | {k['gbps']:.1f} ({100 * k['gbps'] / copy:.0f}%, {100 * k['gbps'] / clone:.0f}%) "
              f"| {e['median_ms'] / k['median_ms']:.2f}x | {c['median_ms'] / k['median_ms']:.2f}x |", flush=True)
    print("wrote", common.write_json("layer_norm", info))


if __name__ == "__main__":
    main()
