"""router_topk benchmark: kernel vs torch.topk vs the reference (eager and torch.compile'd).

The issue's shapes: T=4096 tokens, E in {64, 128, 256} experts, k=8, fp32 and bf16 scores
(softmaxed, as a router's). torch.topk is the plain-torch baseline (it promises no tie order,
so it is not a drop-in; the kernel is exact). Also topk (the general op) on the same rows.
Prints GB/s of scores read and writes benchmarks/results/router_topk.json.

    python benchmarks/router_topk.py [--reps 30] [--experts 64,128,256] [--no-compile]
"""

from __future__ import annotations

import argparse
import sys

import torch

from tokamax_torch.ops import router_topk as rt
from tokamax_torch.ops import topk as tk

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import common  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", default="64,128,256")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    compiled_reference = torch.compile(lambda s, k: rt.reference(s, k), fullgraph=True)
    rows = []
    print(f"router_topk T={args.tokens} k={args.k}, {torch.get_num_threads()} threads; median ms (GB/s of scores)")
    print("| dtype | E | kernel | torch.topk | reference | compiled ref | topk op | kernel vs torch.topk |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for experts in [int(e) for e in args.experts.split(",")]:
            scores = torch.randn(args.tokens, experts).softmax(-1).to(dtype)
            k = args.k
            fns = {"kernel": lambda: rt.kernel(scores, k), "torch.topk": lambda: torch.topk(scores, k),
                   "reference": lambda: rt.reference(scores, k), "topk op": lambda: tk.kernel(scores, k)}
            if not args.no_compile:
                fns["compiled ref"] = lambda: compiled_reference(scores, k)
            times = dict(zip(fns, common.time_interleaved(list(fns.values()), warmup=3, reps=args.reps)))
            gbps = lambda name: scores.numel() * scores.element_size() / times[name]["median_ms"] / 1e6  # noqa: E731
            cell = lambda name: (f"{times[name]['median_ms']:.3f} ({gbps(name):.1f})" if name in times  # noqa: E731
                                 else "-")
            speedup = times["torch.topk"]["median_ms"] / times["kernel"]["median_ms"]
            print(f"| {str(dtype).removeprefix('torch.')} | {experts} | {cell('kernel')} | {cell('torch.topk')} | "
                  f"{cell('reference')} | {cell('compiled ref')} | {cell('topk op')} | {speedup:.1f}x |")
            rows.append({"dtype": str(dtype), "experts": experts, "k": k, "tokens": args.tokens,
                         "times": times, "speedup_vs_torch_topk": speedup})
    path = common.write_json("router_topk", {"machine": common.machine(), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
