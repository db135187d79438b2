"""kv_cache_update benchmark: kernel vs reference vs what a user writes (index_copy_ eager and
under torch.compile), on decode and prefill shapes of a bf16 paged cache (16-token pages, 8 KV
heads, D = 128). Reports the bandwidth of the bytes written (T * 2 * Hkv * D * 2) against the
copy bandwidth measured in the same run: a contiguous copy of the same bytes from a T-sized
source into a cache-sized destination (the op reads what it writes once; no kernel can beat a
plain copy). Writes benchmarks/results/kv_cache_update.json.

    python benchmarks/kv_cache_update.py [--reps 20]
"""

from __future__ import annotations

import argparse
import sys

import torch

from tokamax_torch.ops import kv_cache_update as kvc

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import common  # noqa: E402

PAGES, PAGE_SIZE, HEADS, D = 4096, 16, 8, 128  # a 256 MiB bf16 cache (65536 slots)
SHAPES = {"decode-64": dict(tokens=64, order="random"), "decode-512": dict(tokens=512, order="random"),
          "prefill-4096": dict(tokens=4096, order="consecutive"),
          "prefill-32768": dict(tokens=32768, order="consecutive")}


def index_copy(cache, keys, values, slots):
    """What a user writes: the rows interleaved, index_copy_ into the flattened slots."""
    rows = torch.stack([keys, values], 2).reshape(keys.shape[0], 2 * keys.shape[1], keys.shape[2])
    cache.view(-1, cache.shape[2], cache.shape[3]).index_copy_(0, slots, rows)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=20)
    options = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(PAGES, PAGE_SIZE, 2 * HEADS, D, dtype=torch.bfloat16)
    compiled_copy = torch.compile(index_copy, fullgraph=True, dynamic=True)
    rows = []
    for name, shape in SHAPES.items():
        t = shape["tokens"]
        keys = torch.randn(t, HEADS, D, generator=g).to(torch.bfloat16)
        values = torch.randn(t, HEADS, D, generator=g).to(torch.bfloat16)
        if shape["order"] == "random":
            slots = torch.randperm(PAGES * PAGE_SIZE, generator=g)[:t]
        else:
            slots = torch.arange(t) + 1000
        written = 2 * keys.nbytes
        src = torch.randn(written // 2, generator=g).to(torch.bfloat16)
        dst = cache.view(-1)[1000 * 2 * HEADS * D:][:src.numel()]
        impls = {"kernel": lambda: kvc.kernel(cache, keys, values, slots),
                 "reference": lambda: kvc.reference(cache, keys, values, slots),
                 "index_copy_": lambda: index_copy(cache, keys, values, slots),
                 "compiled index_copy_": lambda: compiled_copy(cache, keys, values, slots),
                 "copy ceiling": lambda: dst.copy_(src)}
        times = common.time_interleaved(list(impls.values()), warmup=3, reps=options.reps)
        ceiling_gbps = written / times[-1]["min_ms"] / 1e6
        for impl, stats in zip(impls, times):
            gbps = written / stats["min_ms"] / 1e6
            rows.append({"shape": name, "tokens": t, "impl": impl, "min_ms": stats["min_ms"],
                         "median_ms": stats["median_ms"], "written_gbps": gbps, "of_copy": gbps / ceiling_gbps})
    print(f"kv_cache_update, bf16 cache [{PAGES}, {PAGE_SIZE}, {2 * HEADS}, {D}], {torch.get_num_threads()} threads")
    print(f"{'shape':<15}{'impl':<22}{'min ms':>9}{'median ms':>11}{'GB/s written':>14}{'of copy':>9}")
    for r in rows:
        print(f"{r['shape']:<15}{r['impl']:<22}{r['min_ms']:>9.4f}{r['median_ms']:>11.4f}"
              f"{r['written_gbps']:>14.2f}{r['of_copy']:>8.0%}")
    path = common.write_json("kv_cache_update", {"machine": common.machine(), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
