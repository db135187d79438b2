"""Command line autotuner: ``python -m tokamax_torch.autotune ragged_dot --shape M,K,N,G ...``.

Tunes the op for the given shapes (random inputs; group sizes an even split unless given),
merges the timings into the user cache (``TOKAMAX_TORCH_CACHE_DIR``) and prints the table.
"""

from __future__ import annotations

import argparse
import sys

import torch

import tokamax_torch
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokamax_torch.autotune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("op", choices=["ragged_dot"])
    parser.add_argument("--shape", action="append", required=True,
                        help="M,K,N,G; repeat for several shapes")
    parser.add_argument("--dtype", action="append", default=None, choices=["float32", "bfloat16", "float16"],
                        help="repeat for several dtypes (default float32)")
    parser.add_argument("--form", default="default", choices=list(FORMS))
    parser.add_argument("--group-sizes", default=None, help="representative sizes, comma separated")
    parser.add_argument("--products", default=None, help="comma separated subset of forward,dlhs,drhs")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=None, help="time budget per shape and dtype, split between the products")
    parser.add_argument("--max-configs", type=int, default=None)
    parser.add_argument("--no-write", action="store_true", help="do not write the user cache")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    for shape in args.shape:
        for dtype_name in args.dtype or ["float32"]:
            call_args, kwargs = ragged_dot_args(shape, getattr(torch, dtype_name), args.form, args.group_sizes)
            result = tokamax_torch.autotune(
                tokamax_torch.ragged_dot, *call_args, reps=args.reps, warmup=args.warmup, budget_s=args.budget_s,
                max_configs=args.max_configs, write_cache=not args.no_write,
                products=args.products.split(",") if args.products else None, **kwargs)
            print(f"shape {shape}, {dtype_name}")
            print(result)
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
