"""dot_product_attention benchmark: the tokamax kernel against F.scaled_dot_product_attention.

Every case runs both side by side in one process, their timed calls alternating (7 of each
after a warm-up, decode 48 or more; the median), so a drift of the machine's speed hits both. SDPA gets the equivalent inputs: [B, N, T, H]
transposed views (no copies), enable_gqa=True, and an explicit dense bool mask where it has no
argument for the feature (sliding windows, packed segments). Reported per case: median time,
useful GFLOP/s (visible (query, key) pairs only) and the fraction of the fp32 FMA peak measured
in this run, or for decode the read bandwidth of K and V against the measured read ceiling; and
the peak resident-memory growth of one call. Writes benchmarks/results/attention.json.

    python benchmarks/attention.py [--quick]

Per ISA tier (issue 22): one table per tier, each case (fp32 and bf16, forward and
forward+backward) timed against SDPA, interleaved in one process, ratio = SDPA ms / tokamax ms,
cases below 1.0x marked. Each tier runs in a subprocess with TOKAMAX_CPU_ISA=<tier> and PyTorch
capped to the same instructions (common.run_tiers); tiers above the CPU's best are skipped.
Writes benchmarks/results/attention_tiers.json:

    python benchmarks/attention.py --tiers all [--quick]
"""

from __future__ import annotations

import argparse
import math
import statistics
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

import tokamax_torch  # noqa: E402


# ---- cases --------------------------------------------------------------------------------------

def visible_pairs(t, s, *, causal=False, window=None, segments=None) -> int:
    i = torch.arange(t)[:, None]
    j = torch.arange(s)[None, :]
    visible = torch.ones(t, s, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= (j >= i - window[0]) & (j <= i + window[1])
    if segments is not None:
        visible &= (i * segments // t) == (j * segments // s)
    return int(visible.sum())


def dense_mask(t, s, *, window=None, segments=None):
    i = torch.arange(t)[:, None]
    j = torch.arange(s)[None, :]
    visible = torch.ones(t, s, dtype=torch.bool)
    if window is not None:
        visible &= (j >= i - window[0]) & (j <= i + window[1])
    if segments is not None:
        visible &= (i * segments // t) == (j * segments // s)
    return visible


def segment_ids(b, length, segments):
    return (torch.arange(length) * segments // length).to(torch.int32).repeat(b, 1)


def make_case(name, b, t, s, n, k, h, dtype, *, causal=False, window=None, segments=None):
    return dict(name=name, b=b, t=t, s=s, n=n, k=k, h=h, dtype=dtype, causal=causal, window=window,
                segments=segments)


def cases(quick: bool):
    scale = 2 if quick else 1
    f32, bf16 = torch.float32, torch.bfloat16
    prefill = dict(b=1, t=2048 // scale, s=2048 // scale, h=128)
    long = dict(b=1, t=4096 // scale, s=4096 // scale, n=16, k=16, h=128)
    return [
        make_case("prefill causal", n=16, k=16, dtype=f32, causal=True, **prefill),
        make_case("prefill causal", n=16, k=16, dtype=bf16, causal=True, **prefill),
        make_case("prefill causal GQA 32/8", n=32, k=8, dtype=f32, causal=True, **prefill),
        make_case("window (256, 0)", dtype=f32, window=(256, 0), **long),
        make_case("8 packed segments", dtype=f32, segments=8, **long),
    ]


def tokamax_call(c, q, k, v):
    kwargs = {}
    if c["causal"]:
        kwargs["is_causal"] = True
    if c["window"] is not None:
        kwargs["local_window_size"] = c["window"]
    if c["segments"] is not None:
        kwargs["q_segment_ids"] = segment_ids(c["b"], c["t"], c["segments"])
        kwargs["kv_segment_ids"] = segment_ids(c["b"], c["s"], c["segments"])
    return lambda: tokamax_torch.dot_product_attention(q, k, v, **kwargs)


def sdpa_call(c, q, k, v):
    mask = None
    if c["window"] is not None or c["segments"] is not None:
        mask = dense_mask(c["t"], c["s"], window=c["window"], segments=c["segments"])
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=c["causal"],
                                                  enable_gqa=True).transpose(1, 2)


def run_case(c, backward: bool, reps: int, memory_only: bool = False) -> list[dict]:
    torch.manual_seed(0)
    q = torch.randn(c["b"], c["t"], c["n"], c["h"]).to(c["dtype"])
    k = torch.randn(c["b"], c["s"], c["k"], c["h"]).to(c["dtype"])
    v = torch.randn(c["b"], c["s"], c["k"], c["h"]).to(c["dtype"])
    pairs = visible_pairs(c["t"], c["s"], causal=c["causal"], window=c["window"], segments=c["segments"])
    # Two GEMMs forward (q·k, p·v), five backward (recompute, dV, dP, dQ, dK): 2 flops per MAC.
    flops = 2 * 2 * c["b"] * c["n"] * c["h"] * pairs * (3.5 if backward else 1.0)
    rows, steps = [], []
    for impl, make in (("tokamax", tokamax_call), ("sdpa", sdpa_call)):
        inputs = [x.detach().requires_grad_(backward) for x in (q, k, v)]
        call = make(c, *inputs)
        if backward:
            dout = torch.randn(c["b"], c["t"], c["n"], c["h"]).to(c["dtype"])

            def step(call=call, inputs=inputs, dout=dout):
                torch.autograd.grad(call(), inputs, dout)
        else:
            def step(call=call):
                with torch.no_grad():
                    call()
        steps.append((impl, step))
    labels = dict(case=c["name"], dtype=str(c["dtype"]).removeprefix("torch."), pass_="fwd+bwd" if backward else "fwd")
    if memory_only:
        for impl, step in steps:
            step()
            rows.append(dict(labels, impl=impl, peak_mib=common.peak_memory_mib(step)))
        return rows
    # The two implementations' calls alternate, so a change of the VM's speed hits both.
    timings = common.time_interleaved([step for _, step in steps], warmup=1, reps=reps)
    for (impl, _), timing in zip(steps, timings):
        rows.append(dict(labels, impl=impl, **timing, gflops=flops / timing["median_ms"] * 1e-6,
                         shape=f"B={c['b']} T={c['t']} S={c['s']} N={c['n']} K={c['k']} H={c['h']}"))
    return rows


def run_decode(reps: int, read_gbps: float, l3_bytes: int, quick: bool) -> list[dict]:
    """T=1, S=4096, N=32, K=8, H=128: rotates over enough KV caches to exceed the last-level
    cache, so each call streams K and V from DRAM as in serving."""
    b, s, n, kh, h = 1, 4096, 32, 8, 128
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        same_read_gbps = float("nan")
        kv_bytes = 2 * b * s * kh * h * torch.tensor([], dtype=dtype).element_size()
        # Four times the L3 between two reads of a cache: at twice (4 bf16 caches) the plain read
        # of the bf16 caches ran at 52-53 GB/s in two runs, above the same runs' 256 MiB probe
        # (32.0 and 46.5): part of it still came from the cache, not DRAM.
        copies = max(2, math.ceil(4 * l3_bytes / kv_bytes)) if not quick else 2
        # A call takes about a millisecond and the VM's neighbours move single calls by 2x: many
        # calls (whole rotations over the caches) make the median stable.
        decode_reps = max(reps, 3 * copies) if quick else max(48, 12 * copies)
        torch.manual_seed(0)
        q = torch.randn(b, 1, n, h).to(dtype)
        caches = [(torch.randn(b, s, kh, h).to(dtype), torch.randn(b, s, kh, h).to(dtype)) for _ in range(copies)]
        for impl in ("tokamax", "sdpa"):
            state = {"i": 0}

            def step(impl=impl, state=state):
                k, v = caches[state["i"] % copies]
                state["i"] += 1
                with torch.no_grad():
                    if impl == "tokamax":
                        tokamax_torch.dot_product_attention(q, k, v)
                    else:
                        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       enable_gqa=True)
            if impl == "tokamax":
                # The same rotation read plainly (the read probe's streaming sum over K's and V's
                # bytes, both threads), its calls alternating with the kernel's: the bandwidth of
                # reading exactly these caches in the same minutes, a second ceiling beside the
                # 256 MiB probe's, which the VM's neighbours move by up to 2x between runs.
                # The read's time is the probe's own (C++, around the streaming loop only), so
                # the call overhead the kernel's Python-side timing includes is not charged to it.
                # It rotates over copies of its own: reading the cache the kernel just read
                # would find it in the L3.
                read_caches = [(k.clone(), v.clone()) for k, v in caches]
                read_state = {"i": 0, "ms": []}

                def plain_read(state=read_state):
                    k, v = read_caches[state["i"] % copies]
                    state["i"] += 1
                    ms = 0.0
                    for x in (k, v):
                        gbps = torch.ops.tokamax._measure_ceilings(x.reshape(-1).view(torch.float32), 0)[2]
                        ms += x.numel() * x.element_size() / gbps * 1e-6
                    state["ms"].append(ms)

                timing, _ = common.time_interleaved([step, plain_read], warmup=copies, reps=decode_reps)
                same_read_gbps = kv_bytes / statistics.median(read_state["ms"][copies:]) * 1e-6
                del read_caches
            else:
                timing = common.time_fn(step, warmup=copies, reps=decode_reps)
            gbps = kv_bytes / timing["median_ms"] * 1e-6
            rows.append(dict(case="decode", dtype=str(dtype).removeprefix("torch."), pass_="fwd", impl=impl,
                             **timing, gbps=gbps, bw_fraction=gbps / read_gbps,
                             same_caches_read_gbps=same_read_gbps, same_caches_fraction=gbps / same_read_gbps,
                             shape=f"B={b} T=1 S={s} N={n} K={kh} H={h}, {copies} KV caches"))
        del caches
    return rows


def peak_for(dtype: str, ceilings: dict) -> float:
    """The compute ceiling of a row: for bf16 the rate of the tier's bf16 product engine where it
    has one (AMX tiles, or vdpbf16ps; SDPA's oneDNN uses the same units), else the fp32 FMA
    peak."""
    if dtype == "bfloat16" and ceilings["bf16_gflops"] > 0:
        return ceilings["bf16_gflops"]
    return ceilings["fma_gflops"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="half-size problems, fewer repetitions")
    parser.add_argument("--tiers", default="", help="comma-separated ISA tiers, or 'all': one table per tier")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        tier_worker(args.quick)
        return
    if args.tiers:
        common.check_tiers_arg(parser, args.tiers)
        tier_tables(args)
        return
    reps = 2 if args.quick else 7
    info = common.machine()
    ceilings = common.measure_ceilings()
    print(f"machine: {info['cpu']} ({info['device_kind']}), {info['threads']} threads, torch {info['torch']}")
    print(f"ceilings (measured now): fp32 FMA peak {ceilings['fma_gflops']:.1f} GFLOP/s ({ceilings['isa']}), "
          f"{ceilings['fma_avx2_gflops']:.1f} with AVX2; read bandwidth {ceilings['read_gbps']:.1f} GB/s; "
          f"bf16 products {ceilings['bf16_gflops']:.1f} GFLOP/s (bf16 rows' %peak is of this when > 0)")
    header = f"{'case':<25}{'dtype':<10}{'pass':<9}{'impl':<9}{'ms':>9}{'GFLOP/s':>9}{'%peak':>7}{'peak MiB':>10}"
    print(header)
    print("-" * len(header))
    rows = []
    runs = [(c, backward) for c in cases(args.quick) for backward in (False, True)
            if not (c["dtype"] == torch.bfloat16 and backward and args.quick)]
    for c, backward in runs:
        rows.extend(run_case(c, backward, reps))
    decode = run_decode(reps, ceilings["read_gbps"], info["l1d_l2_l3_bytes"][2], args.quick)
    # Peak memory last, in its own pass: it makes glibc return every freed buffer to the OS.
    common.enable_peak_memory()
    memory = [m for c, backward in runs for m in run_case(c, backward, reps, memory_only=True)]
    for r, m in zip(rows, memory):
        r["peak_mib"] = m["peak_mib"]
        r["ceiling_gflops"] = peak_for(r["dtype"], ceilings)
        print(f"{r['case']:<25}{r['dtype']:<10}{r['pass_']:<9}{r['impl']:<9}{r['median_ms']:>9.1f}"
              f"{r['gflops']:>9.1f}{100 * r['gflops'] / r['ceiling_gflops']:>6.1f}%{r['peak_mib']:>10.1f}")
    for r in decode:
        rows.append(r)
        print(f"{r['case']:<25}{r['dtype']:<10}{r['pass_']:<9}{r['impl']:<9}{r['median_ms']:>9.2f}"
              f"{r['gbps']:>7.1f}GB/s {100 * r['bw_fraction']:>4.0f}%bw   "
              f"({100 * r['same_caches_fraction']:.0f}% of a plain read of the same caches, "
              f"{r['same_caches_read_gbps']:.1f} GB/s; peak memory not measured)")
    print_targets(rows, args.quick)
    path = common.write_json("attention", {"machine": info, "ceilings": ceilings, "quick": args.quick, "rows": rows})
    print(f"wrote {path}")


def _time(rows, **match):
    for r in rows:
        if all(r[k] == v for k, v in match.items()):
            return r
    return None


def print_targets(rows, quick: bool) -> None:
    print("\ntargets (speed-up over SDPA in this run; decode: fraction of measured read bandwidth):")
    if quick:
        print("  (--quick: half-size problems; the targets are stated for the full sizes)")

    def speedup(case, dtype, pass_, target):
        ours = _time(rows, case=case, dtype=dtype, pass_=pass_, impl="tokamax")
        theirs = _time(rows, case=case, dtype=dtype, pass_=pass_, impl="sdpa")
        if ours is None or theirs is None:
            print(f"  {case} {dtype} {pass_}: not measured")
            return
        ratio = theirs["median_ms"] / ours["median_ms"]
        print(f"  {case} {dtype} {pass_}: {ratio:.2f}x (target >= {target}x) {'MET' if ratio >= target else 'MISSED'}"
              f"; peak memory {ours['peak_mib']:.0f} MiB vs SDPA {theirs['peak_mib']:.0f} MiB")

    speedup("prefill causal", "float32", "fwd", 1.2)
    speedup("prefill causal", "float32", "fwd+bwd", 1.2)
    speedup("prefill causal", "bfloat16", "fwd", 2.0)
    speedup("prefill causal", "bfloat16", "fwd+bwd", 2.0)
    speedup("prefill causal GQA 32/8", "float32", "fwd", 1.5)
    speedup("prefill causal GQA 32/8", "float32", "fwd+bwd", 1.5)
    speedup("window (256, 0)", "float32", "fwd", 3.0)
    speedup("window (256, 0)", "float32", "fwd+bwd", 3.0)
    speedup("8 packed segments", "float32", "fwd", 3.0)
    speedup("8 packed segments", "float32", "fwd+bwd", 3.0)
    for dtype in ("float32", "bfloat16"):
        r = _time(rows, case="decode", dtype=dtype, impl="tokamax")
        s = _time(rows, case="decode", dtype=dtype, impl="sdpa")
        print(f"  decode {dtype}: {100 * r['bw_fraction']:.0f}% of the read probe's bandwidth (target >= 70%) "
              f"{'MET' if r['bw_fraction'] >= 0.7 else 'MISSED'}; {100 * r['same_caches_fraction']:.0f}% of a plain "
              f"read of the same caches {'MET' if r['same_caches_fraction'] >= 0.7 else 'MISSED'}; "
              f"SDPA {100 * s['bw_fraction']:.0f}% / {100 * s['same_caches_fraction']:.0f}%")



# ---- per-tier tables (issue 22) -----------------------------------------------------------------

def tier_cases(quick: bool):
    """cases(quick) with each geometry in both fp32 and bf16 (decode left out: its figure of
    merit is the read bandwidth, not a ratio to SDPA)."""
    seen, out = set(), []
    for c in cases(quick):
        key = tuple((k, v) for k, v in c.items() if k != "dtype")
        if key not in seen:
            seen.add(key)
            out += [dict(c, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)]
    return out


def tier_worker(quick: bool) -> None:
    """One tier in this process (common.run_tier_worker): a JSON line per (case, dtype, pass, impl)."""
    reps = 3 if quick else 7
    for c in tier_cases(quick):
        for backward in (False, True):
            for r in run_case(c, backward, reps):
                common.emit_worker_row({k: r[k] for k in ("case", "dtype", "pass_", "impl", "median_ms", "shape")})


def tier_tables(args) -> None:
    checkouts = {"tokamax": str(pathlib.Path(__file__).resolve().parent.parent)}

    def print_table(tier, results):
        rows = results["tokamax"]
        head = f"{'case':<25}{'shape':<36}{'dtype':<10}{'pass':<9}{'tokamax ms':>11}{'sdpa ms':>10}{'ratio':>8}"
        print(head)
        print("-" * len(head))
        for c in tier_cases(args.quick):
            dtype = str(c["dtype"]).removeprefix("torch.")
            for pass_ in ("fwd", "fwd+bwd"):
                ours = _time(rows, case=c["name"], dtype=dtype, pass_=pass_, impl="tokamax")
                theirs = _time(rows, case=c["name"], dtype=dtype, pass_=pass_, impl="sdpa")
                if ours is None or theirs is None:
                    continue
                print(f"{c['name']:<25}{ours['shape']:<36}{dtype:<10}{pass_:<9}{ours['median_ms']:>11.1f}"
                      f"{theirs['median_ms']:>10.1f}{common.ratio_text(theirs['median_ms'] / ours['median_ms'])}")

    payload = common.run_tiers(args.tiers, __file__, ["--quick"] if args.quick else [], checkouts, print_table)
    common.write_tiers_json("attention_tiers", dict(payload, quick=args.quick))


if __name__ == "__main__":
    main()
