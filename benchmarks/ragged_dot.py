"""ragged_dot benchmark: kernel vs reference vs torch._grouped_mm vs a torch.mm loop.

Forward and forward+backward, fp32 and bf16, on the issue's three MoE shapes, with the fp32
FMA peak and the read bandwidth measured in the same run. Prints a table and writes
benchmarks/results/ragged_dot.{json,png}.

    python benchmarks/ragged_dot.py [--reps 5] [--shapes a,b,c] [--dtypes float32,bfloat16]

Per ISA tier (issue 22): one table per tier, each case's ratio to the fastest PyTorch path
measured in the same process (torch._grouped_mm, a loop of torch.mm), cases below 1.0x marked.
Each tier runs in a subprocess with TOKAMAX_CPU_ISA=<tier> for the kernel and PyTorch capped to
the same instructions (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS):

    python benchmarks/ragged_dot.py --tiers all [--quick] [--compare /path/to/other/checkout]

--quick: 3 timed calls per case. --compare: a second checkout's tokamax_torch (e.g. main) is
timed in the same subprocess, interleaved with this one, as the "before" column. Shape z is
issue 22's MoE case: 128 groups of Zipf-distributed sizes (group i ~ 1 / (i + 1)).
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
    "z": dict(m=4096, k=1024, n=512, g=128, zipf=True),
}


def group_sizes_of(s) -> torch.Tensor:
    """Equal groups, or for a zipf shape sizes ~ 1 / (i + 1), the remainder on the first."""
    if not s.get("zipf"):
        return torch.full((s["g"],), s["m"] // s["g"], dtype=torch.int32)
    weights = torch.tensor([1.0 / (i + 1) for i in range(s["g"])], dtype=torch.float64)
    sizes = torch.floor(weights / weights.sum() * s["m"]).to(torch.int64)
    sizes[0] += s["m"] - int(sizes.sum())
    return sizes.to(torch.int32)


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
    parser.add_argument("--tiers", default="", help="comma-separated ISA tiers, or 'all': one table per tier")
    parser.add_argument("--quick", action="store_true", help="per-tier tables with 3 timed calls per case")
    parser.add_argument("--compare", default="", help="another checkout whose tokamax_torch is timed as 'before'")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        tier_worker(args)
        return
    if args.tiers:
        common.check_tiers_arg(parser, args.tiers)
        tier_tables(args)
        return

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
            gs = group_sizes_of(s)
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


# ---- per-tier tables (issue 22) -----------------------------------------------------------------

# A loop of torch.mm under autograd with many groups takes seconds (split/cat backward): it is
# timed for the forward always and for forward+backward up to this many groups.
LOOP_BACKWARD_MAX_GROUPS = 16
TORCH_PATHS = ("torch._grouped_mm", "torch.mm loop")


def tier_worker(args) -> None:
    """One tier in this process (common.run_tier_worker): a JSON line of median ms per (shape,
    dtype, pass, implementation)."""
    # A --compare checkout runs in its own worker process: both register torch.ops.tokamax.
    reps = 3 if args.quick else args.reps
    torch.manual_seed(0)
    for shape_name in args.shapes.split(","):
        s = SHAPES[shape_name]
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            lhs = torch.randn(s["m"], s["k"], dtype=dtype)
            rhs = torch.randn(s["g"], s["k"], s["n"], dtype=dtype)
            gs = group_sizes_of(s)
            for backward in (False, True):
                fns = {"tokamax": lambda l, r, g: tokamax_torch.ragged_dot(l, r, g), "torch._grouped_mm": grouped_mm}
                if not backward or s["g"] <= LOOP_BACKWARD_MAX_GROUPS:
                    fns["torch.mm loop"] = mm_loop
                # Interleaved calls (common.time_interleaved): each sees the same drift of a shared machine.
                steps = []
                for fn in fns.values():
                    if backward:
                        l = lhs.detach().requires_grad_()
                        r = rhs.detach().requires_grad_()
                        dout = torch.randn(lhs.shape[0], rhs.shape[2], dtype=dtype)

                        def step(fn=fn, l=l, r=r, dout=dout):
                            l.grad = r.grad = None
                            fn(l, r, gs).backward(dout)
                    else:
                        def step(fn=fn):
                            with torch.no_grad():
                                fn(lhs, rhs, gs)
                    steps.append(step)
                times = common.time_interleaved(steps, reps=reps)
                for name, t in zip(fns, times):
                    common.emit_worker_row(dict(shape=shape_name, dtype=dtype_name, backward=backward,
                                                implementation=name, median_ms=t["median_ms"]))


def tier_tables(args) -> None:
    import pathlib

    checkouts = {"after": str(pathlib.Path(__file__).resolve().parent.parent)}
    if args.compare:
        checkouts["before"] = args.compare
    worker_args = ["--shapes", args.shapes, "--dtypes", args.dtypes, "--reps", str(args.reps)]
    worker_args += ["--quick"] if args.quick else []

    def print_table(tier, results):
        after, before = results["after"], results.get("before", [])
        head = f"{'case':<40}{'dtype':<10}{'pass':<9}{'tokamax ms':>11}{'torch ms':>10}{'fastest':>19}{'ratio':>8}"
        if before:
            head += f"{'before ms':>11}{'ratio':>8}"
        print(head)
        print("-" * len(head))
        for shape_name in args.shapes.split(","):
            s = SHAPES[shape_name]
            label = f"({shape_name}) M={s['m']} K={s['k']} N={s['n']} G={s['g']}" + (" Zipf" if s.get("zipf") else "")
            for dtype_name in args.dtypes.split(","):
                for backward in (False, True):
                    def pick(rows, name):
                        return next((r["median_ms"] for r in rows if r["shape"] == shape_name and
                                     r["dtype"] == dtype_name and r["backward"] == backward and
                                     r["implementation"] == name), None)
                    ours = pick(after, "tokamax")
                    torch_paths = {n: v for n in TORCH_PATHS if (v := pick(after, n)) is not None}
                    if ours is None or not torch_paths:
                        continue
                    fastest = min(torch_paths, key=torch_paths.get)
                    line = (f"{label:<40}{dtype_name:<10}{'fwd+bwd' if backward else 'fwd':<9}{ours:>11.2f}"
                            f"{torch_paths[fastest]:>10.2f}{fastest:>19}{common.ratio_text(torch_paths[fastest] / ours)}")
                    old = pick(before, "tokamax")
                    old_torch = min((v for n in TORCH_PATHS if (v := pick(before, n)) is not None), default=None)
                    if old is not None and old_torch is not None:
                        line += f"{old:>10.2f}{common.ratio_text(old_torch / old)}"
                    print(line)

    payload = common.run_tiers(args.tiers, __file__, worker_args, checkouts, print_table)
    common.write_tiers_json("ragged_dot_tiers", payload)


if __name__ == "__main__":
    main()
