"""ragged_paged_attention benchmark (issue 19 §3), side by side in one run:

- decode: B sequences of one new token each, 1k-8k cached tokens (seeded, uniform), Hq=32,
  Hkv=8, D=128, pages of 16 and 128 tokens scattered over the cache, bf16 and fp32. The kernel
  against what a user would do without us (gather each sequence's pages with index_select, then
  SDPA with GQA) and against dot_product_attention on the same keys stored contiguously
  ([B, max_len, Hkv, D], key_value_seq_lengths); GB/s over the KV bytes actually read
  (sum(kv_lens) * 2 * Hkv * D * itemsize) against the read bandwidth measured in the same run.
- prefill (new sequences, causal) and mixed (decode sequences plus a prefill chunk on a cached
  prefix) against dot_product_attention on the same tokens stored contiguously (the chunk's
  causal mask bottom-right aligned with a local window).

Writes benchmarks/results/ragged_paged_attention.json.

    python benchmarks/ragged_paged_attention.py [--reps 5] [--batch 32] [--max-len 8192] [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import tokamax_torch
from tokamax_torch.ops import ragged_paged_attention as rpa

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import common  # noqa: E402

HQ, HKV, D = 32, 8, 128


def paged_batch(kv_lens, q_lens, page_size, dtype, g):
    """A cache holding every sequence's keys at scattered pages, and the call's arguments."""
    seqs = len(kv_lens)
    pages_per_seq = max(-(-k // page_size) for k in kv_lens)
    used = [-(-k // page_size) for k in kv_lens]
    total_pages = sum(used) + 1
    order = torch.randperm(total_pages, generator=g)
    table = torch.zeros(seqs, pages_per_seq, dtype=torch.int32)
    start = 0
    for s, n in enumerate(used):
        table[s, :n] = order[start:start + n]
        start += n
    cache = torch.randn(total_pages, page_size, 2 * HKV, D, generator=g).to(dtype)
    tokens = sum(q_lens)
    queries = torch.randn(tokens, HQ, D, generator=g).to(dtype)
    keys = torch.randn(tokens, HKV, D, generator=g).to(dtype)
    values = torch.randn(tokens, HKV, D, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    decode = 0  # the leading one-token sequences
    while decode < seqs and q_lens[decode] == 1:
        decode += 1
    dist = torch.tensor([decode, decode, seqs], dtype=torch.int32)
    return (queries, keys, values, cache, torch.tensor(kv_lens, dtype=torch.int32), table.view(-1), cu, dist)


def contiguous_kv(args, pad_to):
    """The sequences' keys and values as dot_product_attention takes them: [B, pad_to, Hkv, D]."""
    _, _, _, cache, kv_lens, pages, _, _ = args
    seqs, page_size = kv_lens.shape[0], cache.shape[1]
    table = pages.view(seqs, -1).long()
    k = torch.zeros(seqs, pad_to, HKV, D, dtype=cache.dtype)
    v = torch.zeros_like(k)
    for s in range(seqs):
        n = int(kv_lens[s])
        rows = cache.index_select(0, table[s, :-(-n // page_size)]).flatten(0, 1)[:n]
        k[s, :n] = rows[:, 0::2]
        v[s, :n] = rows[:, 1::2]
    return k, v


def gather_sdpa(args, scale):
    """What a user writes without us: per sequence, its pages gathered with index_select, then SDPA."""
    queries, _, _, cache, kv_lens, pages, cu, _ = args
    seqs, page_size = kv_lens.shape[0], cache.shape[1]
    table = pages.view(seqs, -1)
    out = torch.empty_like(queries)
    for s in range(seqs):
        n, q0, q1 = int(kv_lens[s]), int(cu[s]), int(cu[s + 1])
        rows = cache.index_select(0, table[s, :-(-n // page_size)]).flatten(0, 1)[:n]
        k, v = rows[:, 0::2].transpose(0, 1), rows[:, 1::2].transpose(0, 1)  # [Hkv, n, D]
        q = queries[q0:q1].transpose(0, 1)
        out[q0:q1] = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True,
                                                    is_causal=False).transpose(0, 1)
    return out


def decode_rows(options, ceilings, g):
    rows = []
    lens = torch.randint(options.min_len, options.max_len + 1, (options.batch,), generator=g).tolist()
    scale = D ** -0.5
    for dtype in (torch.bfloat16, torch.float32):
        for page_size in (16, 128):
            args = paged_batch(lens, [1] * options.batch, page_size, dtype, g)
            k, v = contiguous_kv(args, options.max_len)
            q = args[0].unsqueeze(1)  # [B, 1, Hq, D]
            kv_len = args[4].long()
            read = sum(lens) * 2 * HKV * D * args[3].element_size()
            impls = {
                "kernel": lambda: rpa.kernel(*args, sm_scale=scale),
                "gather+SDPA": lambda: gather_sdpa(args, scale),
                "dot_product_attention (contiguous)": lambda: tokamax_torch.dot_product_attention(
                    q, k, v, scale=scale, key_value_seq_lengths=kv_len),
            }
            times = common.time_interleaved(list(impls.values()), warmup=1, reps=options.reps)
            kernel_ms = times[0]["min_ms"]
            for impl, t in zip(impls, times):
                gbps = read / t["min_ms"] / 1e6
                rows.append({"case": "decode", "dtype": str(dtype).removeprefix("torch."), "page_size": page_size,
                             "impl": impl, "min_ms": t["min_ms"], "median_ms": t["median_ms"], "kv_gbps": gbps,
                             "of_read_bw": gbps / ceilings["read_gbps"], "kernel_speedup": t["min_ms"] / kernel_ms})
            del k, v, args
    return rows


def prefill_rows(options, g):
    rows = []
    scale = D ** -0.5
    n = options.prefill_len
    cases = {
        # New sequences: the whole prompt at once, causal.
        f"prefill {options.prefill_seqs}x{n}": ([n] * options.prefill_seqs, [n] * options.prefill_seqs),
        # 16 decode sequences of 2048 cached tokens, and a chunk of n tokens on a 2048 - n prefix.
        f"mixed 16x1 + 1x{n}": ([2048] * 16 + [2048], [1] * 16 + [n]),
    }
    for dtype in (torch.bfloat16, torch.float32):
        for name, (kv_lens, q_lens) in cases.items():
            args = paged_batch(kv_lens, q_lens, 16, dtype, g)
            k, v = contiguous_kv(args, max(kv_lens))
            queries = args[0]
            if name.startswith("prefill"):
                q = queries.view(len(q_lens), n, HQ, D)
                baseline = lambda: tokamax_torch.dot_product_attention(q, k, v, scale=scale, is_causal=True)  # noqa
            else:
                qd, qp = queries[:16].unsqueeze(1), queries[16:].unsqueeze(0)
                kd, vd, kp, vp = k[:16], v[:16], k[16:], v[16:]
                # Bottom-right causal: query t sees keys s <= t + (S - T).
                window = (2048, 2048 - n)
                baseline = lambda: (tokamax_torch.dot_product_attention(qd, kd, vd, scale=scale),  # noqa
                                    tokamax_torch.dot_product_attention(qp, kp, vp, scale=scale,
                                                                        local_window_size=window))
            impls = {"kernel": lambda: rpa.kernel(*args, sm_scale=scale),
                     "dot_product_attention (contiguous)": baseline}
            times = common.time_interleaved(list(impls.values()), warmup=1, reps=options.reps)
            for impl, t in zip(impls, times):
                rows.append({"case": name, "dtype": str(dtype).removeprefix("torch."), "page_size": 16, "impl": impl,
                             "min_ms": t["min_ms"], "median_ms": t["median_ms"],
                             "kernel_speedup": t["min_ms"] / times[0]["min_ms"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--prefill-seqs", type=int, default=2)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="batch 8, lengths 512-2048, prefill 1x512")
    options = parser.parse_args()
    if options.quick:
        options.batch, options.min_len, options.max_len = 8, 512, 2048
        options.prefill_seqs, options.prefill_len = 1, 512
    g = torch.Generator().manual_seed(0)
    ceilings = common.measure_ceilings()
    rows = decode_rows(options, ceilings, g) + prefill_rows(options, g)
    print(f"ragged_paged_attention, Hq={HQ} Hkv={HKV} D={D}, {torch.get_num_threads()} threads, "
          f"read bandwidth {ceilings['read_gbps']:.1f} GB/s ({common.machine()['device_kind']})")
    print(f"{'case':<22}{'dtype':<10}{'page':>5}  {'impl':<36}{'min ms':>9}{'median ms':>11}{'KV GB/s':>9}"
          f"{'of read':>8}{'x kernel':>9}")
    for r in rows:
        gbps = f"{r['kv_gbps']:>9.2f}{r['of_read_bw']:>8.0%}" if "kv_gbps" in r else " " * 17
        print(f"{r['case']:<22}{r['dtype']:<10}{r['page_size']:>5}  {r['impl']:<36}{r['min_ms']:>9.2f}"
              f"{r['median_ms']:>11.2f}{gbps}{r['kernel_speedup']:>9.2f}")
    path = common.write_json("ragged_paged_attention", {"machine": common.machine(), "ceilings": ceilings,
                                                        "options": vars(options), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
