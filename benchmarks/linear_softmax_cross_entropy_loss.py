"""linear_softmax_cross_entropy_loss benchmark: the fused kernel against F.linear + F.cross_entropy
(eager) and its torch.compile, forward+backward, at the issue's LM-head shapes.

Weights are an nn.Linear weight [V, H] (the kernel gets its transposed view, no copy; the
reference calls F.linear on it). Loss reduction sum; the reference computes the logits in the
input dtype (bf16 logits for bf16). Each case times the three implementations interleaved (1
warm-up, then `--reps` calls of each; the median), reports useful GFLOP/s (6·B·H·V: the kernel's
recomputed logits are not counted) against the active tier's matrix peak measured in this run
(fp32 FMA for fp32, the bf16 engine for bf16), and the growth of the resident set's high-water
mark over one forward+backward (benchmarks/common.py's peak_memory_mib). Writes
benchmarks/results/linear_softmax_cross_entropy_loss.json.

    python benchmarks/linear_softmax_cross_entropy_loss.py [--quick] [--reps N]
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

SHAPES = [(4096, 2048, 32000), (2048, 1024, 128256)]


def reference(x, labels, weight):
    return F.cross_entropy(F.linear(x, weight), labels, reduction="sum")


def kernel(x, labels, weight):
    return tokamax_torch.linear_softmax_cross_entropy_loss(x, labels, weight.t())


def make_step(fn, x, labels, weight):
    def step():
        x.grad = None
        weight.grad = None
        fn(x, labels, weight).backward()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="quarter-size problems")
    parser.add_argument("--reps", type=int, default=2, help="timed calls of each implementation per case")
    args = parser.parse_args()
    info = common.machine()
    ceilings = common.measure_ceilings()
    print(f"machine: {info['cpu']} ({info['device_kind']}), {info['threads']} threads, torch {info['torch']}")
    print(f"ceilings (measured now): fp32 FMA peak {ceilings['fma_gflops']:.1f} GFLOP/s ({ceilings['isa']}); "
          f"bf16 products {ceilings['bf16_gflops']:.1f} GFLOP/s")
    compiled = torch.compile(reference)
    impls = {"tokamax": kernel, "eager": reference, "compiled": compiled}
    shapes = [(b // 4, h, v // 4) for b, h, v in SHAPES] if args.quick else SHAPES
    cases = []
    for b, h, v in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(b, h, generator=g).to(dtype).requires_grad_(True)
            weight = (torch.randn(v, h, generator=g) * h**-0.5).to(dtype).requires_grad_(True)
            labels = torch.randint(0, v, (b,), generator=g)
            steps = {name: make_step(fn, x, labels, weight) for name, fn in impls.items()}
            times = common.time_interleaved(list(steps.values()), warmup=1, reps=args.reps)
            cases.append(dict(shape=(b, h, v), dtype=str(dtype).split(".")[1], steps=steps,
                              times=dict(zip(steps, times)), tensors=(x, weight, labels)))
    # Peak memory last: it makes glibc return every freed buffer to the OS (slower allocation).
    common.enable_peak_memory()
    rows = []
    header = f"{'shape B,H,V':<20}{'dtype':<10}{'impl':<10}{'ms':>10}{'GFLOP/s':>9}{'%peak':>7}{'peak MiB':>10}"
    print(header)
    print("-" * len(header))
    for c in cases:
        b, h, v = c["shape"]
        flops = 6 * b * h * v
        ceiling = ceilings["bf16_gflops"] if c["dtype"] == "bfloat16" and ceilings["bf16_gflops"] > 0 \
            else ceilings["fma_gflops"]
        x, weight, _ = c["tensors"]
        for name, step in c["steps"].items():
            x.grad = weight.grad = None  # the call's own gradients count in its peak
            peak = common.peak_memory_mib(step)
            t = c["times"][name]
            gflops = flops / (t["median_ms"] * 1e6)
            row = dict(shape=f"{b},{h},{v}", dtype=c["dtype"], impl=name, median_ms=t["median_ms"],
                       min_ms=t["min_ms"], gflops=gflops, ceiling_gflops=ceiling, fraction_of_peak=gflops / ceiling,
                       peak_mib=peak)
            rows.append(row)
            print(f"{row['shape']:<20}{row['dtype']:<10}{name:<10}{t['median_ms']:>10.0f}{gflops:>9.1f}"
                  f"{100 * gflops / ceiling:>6.1f}%{peak:>10.0f}")
        c["steps"] = None
        c["tensors"] = None
    print("\ntargets (issue 20): peak memory <= 1/8 of eager, time >= 1.0x eager and compiled, >= 70% of peak")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for dtype in ("float32", "bfloat16"):
            by = {r["impl"]: r for r in rows if r["shape"] == shape and r["dtype"] == dtype}
            ours = by["tokamax"]
            print(f"  {shape} {dtype}: memory {ours['peak_mib']:.0f} / {by['eager']['peak_mib']:.0f} MiB = "
                  f"{ours['peak_mib'] / max(by['eager']['peak_mib'], 1e-9):.3f} of eager; "
                  f"{by['eager']['median_ms'] / ours['median_ms']:.2f}x eager, "
                  f"{by['compiled']['median_ms'] / ours['median_ms']:.2f}x compiled; "
                  f"{100 * ours['fraction_of_peak']:.0f}% of peak")
    path = common.write_json("linear_softmax_cross_entropy_loss",
                             {"machine": info, "ceilings": ceilings, "quick": args.quick, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
