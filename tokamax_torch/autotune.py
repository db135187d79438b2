"""Command line autotuner:

    python -m tokamax_torch.autotune ragged_dot --shape M,K,N,G ...
    python -m tokamax_torch.autotune dot_product_attention --shape B,T,S,N,K,H[,Hv] [--causal] ...

Tunes the op for the given shapes (random inputs; ragged_dot's group sizes an even split unless
given), merges the timings into the user cache (``TOKAMAX_TORCH_CACHE_DIR``) and prints the table.
"""

from __future__ import annotations

import argparse
import sys

import torch

import tokamax_torch
from tokamax_torch.ops import dot_product_attention as dpa
from tokamax_torch.ops import ragged_dot as rd

FORMS = {"default": rd.DEFAULT, "trans_rhs": rd.TRANS_RHS, "ragged_contracting": rd.RAGGED_CONTRACTING}


def ragged_dot_args(shape: str, dtype: torch.dtype, form: str, group_sizes: str | None):
    try:
        m, k, n, g = (int(v) for v in shape.split(","))
    except ValueError:
        raise SystemExit(f"--shape must be M,K,N,G (four ints), got {shape!r}") from None
    meta = dict(device="meta", dtype=dtype)
    lhs = torch.empty(m, k, **meta)
    rhs = {"default": (g, k, n), "trans_rhs": (g, n, k), "ragged_contracting": (m, n)}[form]
    sizes = ([int(v) for v in group_sizes.split(",")] if group_sizes
             else torch.empty(g, device="meta", dtype=torch.int32))
    return (lhs, torch.empty(*rhs, **meta), sizes), {"ragged_dot_dimension_numbers": FORMS[form]}


def dot_product_attention_args(shape: str, dtype: torch.dtype, causal: bool, window: str | None,
                               soft_cap: float | None):
    try:
        dims = [int(v) for v in shape.split(",")]
        if len(dims) not in (6, 7):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--shape must be B,T,S,N,K,H or B,T,S,N,K,H,Hv (six or seven ints), got {shape!r}") from None
    b, t, s, n, k, h = dims[:6]
    hv = dims[6] if len(dims) == 7 else h
    meta = dict(device="meta", dtype=dtype)
    kwargs = {"is_causal": causal}
    if window is not None:
        try:
            sizes = tuple(int(v) for v in window.split(","))
            if len(sizes) not in (1, 2):
                raise ValueError
        except ValueError:
            raise SystemExit(f"--window must be W or LEFT,RIGHT (ints), got {window!r}") from None
        kwargs["local_window_size"] = sizes[0] if len(sizes) == 1 else sizes
    if soft_cap is not None:
        kwargs["logits_soft_cap"] = soft_cap
    args = (torch.empty(b, t, n, h, **meta), torch.empty(b, s, k, h, **meta), torch.empty(b, s, k, hv, **meta))
    return args, kwargs


OPS = {
    "ragged_dot": ("M,K,N,G", ",".join(rd.PRODUCTS)),
    "dot_product_attention": ("B,T,S,N,K,H[,Hv]", ",".join(dpa.PRODUCTS)),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokamax_torch.autotune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("op", choices=list(OPS))
    parser.add_argument("--shape", action="append", required=True,
                        help="; ".join(f"{op}: {spec}" for op, (spec, _) in OPS.items()) + "; repeat for several shapes")
    parser.add_argument("--dtype", action="append", default=None, choices=["float32", "bfloat16", "float16"],
                        help="repeat for several dtypes (default float32)")
    parser.add_argument("--form", default="default", choices=list(FORMS), help="ragged_dot only")
    parser.add_argument("--group-sizes", default=None, help="ragged_dot only: representative sizes, comma separated")
    parser.add_argument("--causal", action="store_true", help="dot_product_attention only: is_causal=True")
    parser.add_argument("--window", default=None, help="dot_product_attention only: local_window_size, W or LEFT,RIGHT")
    parser.add_argument("--soft-cap", type=float, default=None, help="dot_product_attention only: logits_soft_cap")
    parser.add_argument("--products", default=None,
                        help="comma separated subset of the op's products: " +
                        "; ".join(f"{op}: {products}" for op, (_, products) in OPS.items()))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=None, help="time budget per shape and dtype, split between the products")
    parser.add_argument("--max-configs", type=int, default=None)
    parser.add_argument("--no-write", action="store_true", help="do not write the user cache")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    attention = args.op == "dot_product_attention"
    misplaced = ([("--form", args.form != "default"), ("--group-sizes", args.group_sizes is not None)] if attention else
                 [("--causal", args.causal), ("--window", args.window is not None), ("--soft-cap", args.soft_cap is not None)])
    for flag, given in misplaced:
        if given:
            parser.error(f"{flag} does not apply to {args.op}")
    for shape in args.shape:
        for dtype_name in args.dtype or ["float32"]:
            dtype = getattr(torch, dtype_name)
            if attention:
                op = tokamax_torch.dot_product_attention
                call_args, kwargs = dot_product_attention_args(shape, dtype, args.causal, args.window, args.soft_cap)
            else:
                op = tokamax_torch.ragged_dot
                call_args, kwargs = ragged_dot_args(shape, dtype, args.form, args.group_sizes)
            result = tokamax_torch.autotune(
                op, *call_args, reps=args.reps, warmup=args.warmup, budget_s=args.budget_s,
                max_configs=args.max_configs, write_cache=not args.no_write,
                products=args.products.split(",") if args.products else None, **kwargs)
            print(f"shape {shape}, {dtype_name}")
            print(result)
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
