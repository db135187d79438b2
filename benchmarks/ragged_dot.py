"""ragged_dot benchmark: kernel vs reference vs torch._grouped_mm vs a torch.mm loop.

Forward and forward+backward, fp32 and bf16, on the issue's three MoE shapes, with the fp32
FMA peak and the read bandwidth measured in the same run. Prints a table and writes
benchmarks/results/ragged_dot.{json,png}.

    python benchmarks/ragged_dot.py [--reps 5] [--shapes a,b,c] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import sys

import torch

import tokamax_torch
from tokamax_torch.ops import ragged_dot as rd

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import common  # noqa: E402

SHAPES = {
    "a": dict(m=8192, k=1024, n=1024, g=8),
    "b": dict(m=4096, k=1024, n=512, g=64),
    "c": dict(m=64, k=2048, n=1024, g=16),
}


def mm_loop(lhs, rhs, group_sizes):
    """What a user writes without a grouped kernel: one torch.mm per group."""
    sizes = group_sizes.tolist()
    total = sum(sizes)
    pieces = [part @ rhs[g] for g, part in enumerate(torch.split(lhs[:total], sizes))]
    if total < lhs.shape[0]:
        pieces.append(lhs.new_zeros(lhs.shape[0] - total, rhs.shape[2]))
    return torch.cat(pieces)


def grouped_mm(lhs, rhs, group_sizes):
    offs = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    return torch._grouped_mm(lhs, rhs, offs=offs)


def tuned_kernel(lhs, rhs, group_sizes):
    """The kernel with the configs of the autotuning cache (heuristics on a miss)."""
    configs = tokamax_torch.get_configs(tokamax_torch.ragged_dot, lhs, rhs, group_sizes, from_autotuning_cache=True)
    return lambda l, r, gs: tokamax_torch.ragged_dot(l, r, gs, configs=configs)


def implementations(lhs, rhs, group_sizes):
    return {
        "tokamax kernel": lambda l, r, gs: tokamax_torch.ragged_dot(l, r, gs),
        "tokamax tuned": tuned_kernel(lhs, rhs, group_sizes),
        "tokamax reference": lambda l, r, gs: rd.reference(l, r, gs),
        "torch._grouped_mm": grouped_mm,
        "torch.mm loop": mm_loop,
    }


def bench_one(fn, lhs, rhs, gs, backward, reps):
    if not backward:
        with torch.no_grad():
            return common.time_fn(lambda: fn(lhs, rhs, gs), reps=reps)
    l = lhs.detach().requires_grad_()
    r = rhs.detach().requires_grad_()
    dout = torch.randn(lhs.shape[0], rhs.shape[2], dtype=lhs.dtype)

    def step():
        l.grad = r.grad = None
        fn(l, r, gs).backward(dout)

    return common.time_fn(step, reps=reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", default="a,b,c")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--configs", default="",
                        help="optional JSON file mapping shape name -> [fwd config list, bwd config list]")
    args = parser.parse_args()

    ceilings = common.measure_ceilings()
    info = common.machine()
    print(f"machine: {info['cpu']} ({info['device_kind']}), {info['threads']} threads, torch {info['torch']}")
    print(f"ceilings (measured now): fp32 FMA peak {ceilings['fma_gflops']:.1f} GFLOP/s with the "
          f"{ceilings['isa']} tier (256-bit AVX2 only: {ceilings['fma_avx2_gflops']:.1f}), "
          f"read bandwidth {ceilings['read_gbps']:.1f} GB/s\n")

    rows = []
    header = f"{'shape':<27}{'dtype':<10}{'pass':<9}{'implementation':<20}{'ms':>9}{'GFLOP/s':>9}{'%peak':>7}{'vs loop':>9}"
    print(header)
    print("-" * len(header))
    for shape_name in args.shapes.split(","):
        s = SHAPES[shape_name]
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            torch.manual_seed(0)
            lhs = torch.randn(s["m"], s["k"], dtype=dtype)
            rhs = torch.randn(s["g"], s["k"], s["n"], dtype=dtype)
            gs = torch.full((s["g"],), s["m"] // s["g"], dtype=torch.int32)
            for backward in (False, True):
                flops = 2 * s["m"] * s["k"] * s["n"] * (3 if backward else 1)
                results = {}
                for name, fn in implementations(lhs, rhs, gs).items():
                    try:
                        results[name] = bench_one(fn, lhs, rhs, gs, backward, args.reps)
                    except Exception as exc:  # e.g. an op without a CPU or autograd path
                        results[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"}
                loop_ms = results["torch.mm loop"].get("median_ms")
                for name, r in results.items():
                    label = f"({shape_name}) M={s['m']} K={s['k']} N={s['n']} G={s['g']}"
                    row = dict(shape=shape_name, **s, dtype=dtype_name, backward=backward, implementation=name,
                               flops=flops, **r)
                    if "median_ms" in r:
                        gflops = flops / r["median_ms"] * 1e-6
                        row["gflops"] = gflops
                        row["fraction_of_peak"] = gflops / ceilings["fma_gflops"]
                        row["speedup_vs_loop"] = loop_ms / r["median_ms"] if loop_ms else None
                        speed = f"{row['speedup_vs_loop']:.2f}x" if loop_ms else "n/a"
                        print(f"{label:<27}{dtype_name:<10}{'fwd+bwd' if backward else 'fwd':<9}{name:<20}"
                              f"{r['median_ms']:>9.2f}{gflops:>9.1f}{100 * row['fraction_of_peak']:>6.0f}%{speed:>9}")
                    else:
                        print(f"{label:<27}{dtype_name:<10}{'fwd+bwd' if backward else 'fwd':<9}{name:<20}  {r['error']}")
                    rows.append(row)
        print()

    path = common.write_json("ragged_dot", {"machine": info, "ceilings": ceilings, "rows": rows})
    print(f"wrote {path}")
    plot(rows, ceilings, path.with_suffix(".png"))
    print_targets(rows, ceilings)
    print_tuning(rows)


def _median(rows, **match):
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and "median_ms" in r:
            return r["median_ms"]
    return None


def print_targets(rows, ceilings) -> None:
    """The issue's targets, checked against this run."""
    print("\ntargets (this run):")

    def line(text, value, target):
        if value is None:
            print(f"  {text}: not measured")
        else:
            print(f"  {text}: {value:.2f} (target >= {target}) {'MET' if value >= target else 'MISSED'}")

    k = _median(rows, shape="a", dtype="float32", backward=False, implementation="tokamax kernel")
    loop = _median(rows, shape="a", dtype="float32", backward=False, implementation="torch.mm loop")
    if k:
        flops = 2 * 8192 * 1024 * 1024
        line("(a) fp32 fwd fraction of FMA peak", flops / k * 1e-6 / ceilings["fma_gflops"], 0.85)
        line("(a) fp32 fwd speed-up vs torch.mm loop", loop / k if loop else None, 1.0)
    k = _median(rows, shape="b", dtype="float32", backward=False, implementation="tokamax kernel")
    loop = _median(rows, shape="b", dtype="float32", backward=False, implementation="torch.mm loop")
    line("(b) fp32 fwd speed-up vs torch.mm loop", loop / k if k and loop else None, 1.5)
    for shape in ("a", "b", "c"):
        for backward in (False, True):
            k = _median(rows, shape=shape, dtype="bfloat16", backward=backward, implementation="tokamax kernel")
            others = [_median(rows, shape=shape, dtype="bfloat16", backward=backward, implementation=n)
                      for n in ("torch._grouped_mm", "torch.mm loop")]
            others = [o for o in others if o]
            line(f"({shape}) bf16 {'fwd+bwd' if backward else 'fwd'} speed-up vs fastest PyTorch bf16 path",
                 min(others) / k if k and others else None, 3.0)
    for shape in ("a", "b", "c"):
        for dtype in ("float32", "bfloat16"):
            k = _median(rows, shape=shape, dtype=dtype, backward=True, implementation="tokamax kernel")
            ref = _median(rows, shape=shape, dtype=dtype, backward=True, implementation="tokamax reference")
            line(f"({shape}) {dtype} fwd+bwd speed-up vs reference under autograd", ref / k if k and ref else None, 1.2)


def print_tuning(rows) -> None:
    """Heuristic vs autotuned configs, side by side (the cache is consulted on the side)."""
    print("\nheuristic vs autotuned configs (tokamax_torch.get_configs(..., from_autotuning_cache=True)):")
    for r in rows:
        if r["implementation"] != "tokamax kernel" or "median_ms" not in r:
            continue
        tuned = _median(rows, shape=r["shape"], dtype=r["dtype"], backward=r["backward"], implementation="tokamax tuned")
        if tuned:
            print(f"  ({r['shape']}) {r['dtype']:<9} {'fwd+bwd' if r['backward'] else 'fwd':<8} heuristic "
                  f"{r['median_ms']:8.2f} ms  tuned {tuned:8.2f} ms  ({r['median_ms'] / tuned:.2f}x)")


def plot(rows, ceilings, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    groups = sorted({(r["shape"], r["dtype"], r["backward"]) for r in rows})
    names = ["tokamax kernel", "tokamax tuned", "tokamax reference", "torch._grouped_mm", "torch.mm loop"]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(groups)), 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [next((r.get("gflops", 0) for r in rows if (r["shape"], r["dtype"], r["backward"]) == grp
                        and r["implementation"] == name), 0) for grp in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=name)
    ax.axhline(ceilings["fma_gflops"], color="k", linestyle="--", linewidth=1,
               label=f"fp32 FMA peak ({ceilings['isa']})")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
    ax.set_xticklabels([f"({s}) {d}\n{'fwd+bwd' if b else 'fwd'}" for s, d, b in groups], fontsize=7)
    ax.set_ylabel("GFLOP/s")
    ax.set_title("ragged_dot, " + tokamax_torch.device_kind() + f", {torch.get_num_threads()} threads")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
