"""MoE data-movement benchmark: moe_permute, ragged_gather, ragged_scatter and ragged_gather_reduce
(forward and forward+backward) against their ATen references, the references under torch.compile,
and a plain contiguous copy of the same bytes measured in the same run (no gather can beat it),
into a preallocated buffer and into a fresh one (as the ops return a fresh output).
Bandwidth is the bytes an ideal kernel moves: rows read plus rows written. Shapes: a bf16 MoE layer
of T tokens, top-k 8 of 64 experts, hidden 2048. Writes benchmarks/results/moe_gather.json.

    python benchmarks/moe_gather.py [--reps 10] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import sys

import torch

from tokamax_torch.ops import moe_permute as mp
from tokamax_torch.ops import ragged_gather as rg
from tokamax_torch.ops import ragged_gather_reduce as rgr
from tokamax_torch.ops import ragged_scatter as rs

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import common  # noqa: E402

K, EXPERTS, HIDDEN = 8, 64, 2048


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=4096)
    options = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    t = options.tokens
    n = t * K
    ids = torch.randint(0, EXPERTS, (t, K), generator=g, dtype=torch.int32)
    x_tokens = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)
    x_rows = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)  # expert outputs, one row per slot
    order, inverse, _ = mp.kernel(ids, EXPERTS)
    gather_idx = (order // K).to(torch.int32)
    start, end = torch.tensor([0], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    rstart, rend = torch.tensor([0], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
    weights = torch.rand(n, generator=g)
    valid = torch.ones(n, dtype=torch.bool)
    row_bytes = HIDDEN * 2
    cases = {
        # name: (kernel, reference, args, bytes moved)
        "moe_permute": (mp.kernel, mp.reference, (ids, EXPERTS), n * 4 + 2 * n * 8),
        "ragged_gather": (rg.kernel, rg.reference, (x_tokens, gather_idx, start, end), 2 * n * row_bytes),
        "ragged_scatter": (rs.kernel, rs.reference, (x_tokens, gather_idx, rstart, rend), 2 * n * row_bytes),
        "ragged_gather_reduce": (rgr.kernel, rgr.reference, (x_rows, inverse.to(torch.int32), weights, valid, K),
                                 (n + t) * row_bytes),
    }
    rows = []
    for name, (kernel, reference, args, nbytes) in cases.items():
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16).fill_(1)
        dst = torch.empty_like(src[: nbytes // 4])
        compiled = torch.compile(reference, fullgraph=True)
        impls = {"kernel": lambda: kernel(*args), "reference": lambda: reference(*args),
                 "compiled reference": lambda: compiled(*args),
                 # Reads and writes half the bytes each: the same traffic as the op.
                 "copy ceiling": lambda: dst.copy_(src[: nbytes // 4]),
                 # The same copy into a fresh output, as the ops return one (page faults included).
                 "clone ceiling": lambda: src[: nbytes // 4].clone()}
        times = common.time_interleaved(list(impls.values()), warmup=3, reps=options.reps)
        for impl, timing in zip(impls, times):
            gbs = nbytes / (timing["median_ms"] * 1e-3) / 1e9
            rows.append(dict(case=name, impl=impl, pass_="forward", median_ms=timing["median_ms"],
                             min_ms=timing["min_ms"], gb_s=gbs))
        if name == "moe_permute":
            continue
        grad_args = [a.clone().requires_grad_(a.is_floating_point()) for a in args[:-1]] + [args[-1]] \
            if name == "ragged_gather_reduce" else [args[0].clone().requires_grad_(True), *args[1:]]

        def fwd_bwd(fn):
            out = fn(*grad_args)
            out.backward(torch.ones_like(out))

        times = common.time_interleaved([lambda: fwd_bwd(kernel), lambda: fwd_bwd(reference)], warmup=2,
                                        reps=options.reps)
        for impl, timing in zip(["kernel", "reference"], times):
            rows.append(dict(case=name, impl=impl, pass_="forward+backward", median_ms=timing["median_ms"],
                             min_ms=timing["min_ms"], gb_s=None))
    print(f"machine: {common.machine()}  threads: {torch.get_num_threads()}  T={t} k={K} E={EXPERTS} H={HIDDEN} bf16")
    print(f"{'case':22s} {'impl':20s} {'pass':17s} {'median ms':>10s} {'GB/s':>8s}")
    for r in rows:
        gbs = "" if r["gb_s"] is None else f"{r['gb_s']:8.1f}"
        print(f"{r['case']:22s} {r['impl']:20s} {r['pass_']:17s} {r['median_ms']:10.3f} {gbs:>8s}")
    common.write_json("moe_gather", dict(machine=common.machine(), tokens=t, rows=rows))


if __name__ == "__main__":
    main()
