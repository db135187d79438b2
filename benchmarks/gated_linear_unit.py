"""gated_linear_unit benchmark: the tokamax kernel (one gated GEMM forward, saved
pre-activations, backward on the GEMM core), the unfused eager reference a user writes (two
F.linear + activation, nn.Linear weights) and torch.compile of it, side by side in one run
(timed calls alternating; the median), forward and forward+backward, SwiGLU at M=4096, K=2048,
N=5632, fp32 and bf16. The forward is compared with the matrix peak of the active tier measured
in the same run (fp32 FMA for fp32; the bf16 product engine, AMX tiles or vdpbf16ps, for bf16),
and the peak resident-memory growth of one forward+backward with each. Writes
benchmarks/results/gated_linear_unit.json.

    python benchmarks/gated_linear_unit.py [--quick] [--reps 3]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

from tokamax_torch.ops import gated_linear_unit as glu  # noqa: E402


def eager(x, w_gate, w_up):
    """The unfused reference: nn.Linear weights [N, K], two F.linear and the activation."""
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def case(m, k, n, dtype, reps, ceilings):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    fused = (torch.randn(k, 2, n, generator=g) / k ** 0.5).to(dtype)  # the kernel's [K, 2, N]
    w_gate, w_up = fused[:, 0].t().contiguous(), fused[:, 1].t().contiguous()  # the same as nn.Linear weights
    dy = torch.randn(m, n, generator=g).to(dtype)
    flops = 2 * m * k * 2 * n  # forward; forward+backward is 3x
    torch._dynamo.reset()
    compiled = torch.compile(eager)
    impls = {
        "kernel": (lambda a, ws: glu.kernel(a, ws[0]), lambda: (fused,)),
        "eager": (lambda a, ws: eager(a, *ws), lambda: (w_gate, w_up)),
        "compiled eager": (lambda a, ws: compiled(a, *ws), lambda: (w_gate, w_up)),
    }

    def fwd(fn, weights):
        return lambda: fn(x, weights())

    def fwd_bwd(fn, weights):
        def run():
            a = x.detach().requires_grad_(True)
            ws = tuple(w.detach().requires_grad_(True) for w in weights())
            fn(a, ws).backward(dy)
        return run

    peak = ceilings["bf16_gflops"] if dtype == torch.bfloat16 and ceilings["bf16_gflops"] > 0 else ceilings["fma_gflops"]
    rows = []
    for label, make, work in (("forward", fwd, flops), ("forward+backward", fwd_bwd, 3 * flops)):
        times = common.time_interleaved([make(*v) for v in impls.values()], warmup=1, reps=reps)
        for name, t in zip(impls, times):
            gflops = work / (t["median_ms"] * 1e-3) / 1e9
            rows.append({"pass": label, "impl": name, "median_ms": t["median_ms"], "min_ms": t["min_ms"],
                         "gflops": gflops, "peak_fraction": gflops / peak})
    return rows, {name: fwd_bwd(*v) for name, v in impls.items()}, peak


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="M=1024")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    m, k, n = (1024 if args.quick else 4096), 2048, 5632
    ceilings = common.measure_ceilings()
    info = {"machine": common.machine(), "ceilings": ceilings, "shape": [m, k, n], "cases": []}
    print(f"{info['machine']['cpu']} ({info['machine']['device_kind']}), {info['machine']['threads']} threads; "
          f"measured now: fp32 FMA {ceilings['fma_gflops']:.0f} GFLOP/s ({ceilings['isa']}), "
          f"bf16 engine {ceilings['bf16_gflops']:.0f} GFLOP/s")
    memory_runs = []
    for dtype in (torch.float32, torch.bfloat16):
        rows, steps, peak = case(m, k, n, dtype, args.reps, ceilings)
        info["cases"].append({"dtype": str(dtype), "peak_gflops": peak, "results": rows})
        memory_runs.append((dtype, steps))
        for label in ("forward", "forward+backward"):
            r = {x["impl"]: x for x in rows if x["pass"] == label}
            kr, er, cr = r["kernel"], r["eager"], r["compiled eager"]
            print(f"| {m}x{k}x{n} | {str(dtype)[6:]} | {label} | {kr['median_ms']:.0f} | {er['median_ms']:.0f} | "
                  f"{cr['median_ms']:.0f} | {kr['gflops']:.0f} ({100 * kr['peak_fraction']:.0f}% of {peak:.0f}) | "
                  f"{er['median_ms'] / kr['median_ms']:.2f}x | {cr['median_ms'] / kr['median_ms']:.2f}x |", flush=True)
    # Peak memory last, in its own pass: it makes glibc return every freed buffer to the OS.
    common.enable_peak_memory()
    for dtype, steps in memory_runs:
        mem = {name: common.peak_memory_mib(step) for name, step in steps.items()}
        info["cases"][[str(dtype) == c["dtype"] for c in info["cases"]].index(True)]["peak_mib"] = mem
        print(f"peak resident growth, forward+backward, {str(dtype)[6:]}: " +
              ", ".join(f"{name} {v:.0f} MiB" for name, v in mem.items()), flush=True)
    print("wrote", common.write_json("gated_linear_unit", info))


if __name__ == "__main__":
    main()
