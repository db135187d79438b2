"""Command line autotuner, one sub-command per op family with configs:

    python -m tokamax_torch.autotune ragged_dot --shape M,K,N,G [--form ...] [--group-sizes ...]
    python -m tokamax_torch.autotune dot_product_attention --shape B,T,S,N,K,H[,Hv] [--causal] ...

Tunes the op for the given shapes (random inputs of them), merges the timings into the user
cache (``TOKAMAX_TORCH_CACHE_DIR``) and prints the table. The sub-commands and their own flags
come from the op registry: each op declares its ``--shape`` format and flags (``Op.cli_shape``,
``Op.add_cli_arguments``, ``Op.cli_call``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from tokamax_torch import _registry

PROG = "python -m tokamax_torch.autotune"
DESCRIPTION = ("Autotunes an op at the given shapes (random inputs of them), merges the timings into the user "
               "cache ($TOKAMAX_TORCH_CACHE_DIR) and prints a table per shape and dtype. "
               f"`{PROG} OP --help` lists the op's flags.")
DTYPES = ("float32", "bfloat16", "float16")


def _common_flags() -> argparse.ArgumentParser:
    """The flags every op's sub-command takes."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dtype", action="append", default=None, choices=DTYPES,
                        help="repeat for several dtypes (default float32)")
    common.add_argument("--products", default=None, help="comma separated subset of the op's products")
    common.add_argument("--reps", type=int, default=5)
    common.add_argument("--warmup", type=int, default=1)
    common.add_argument("--budget-s", type=float, default=None,
                        help="time budget per shape and dtype, split between the products")
    common.add_argument("--max-configs", type=int, default=None)
    common.add_argument("--no-write", action="store_true", help="do not write the user cache")
    return common


def _ops() -> dict:
    """The kernel singletons the command line tunes: every registered op with configs and a
    ``--shape`` format."""
    return {name: f.kernel for name, f in _registry.tunable_families().items() if f.kernel.cli_shape}


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser, and each op's sub-command parser by op name."""
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    commands = parser.add_subparsers(dest="op", metavar="op", required=True)
    common = _common_flags()
    per_op = {}
    for name, op in _ops().items():
        sub = commands.add_parser(name, parents=[common],
                                  help=f"products {', '.join(op.products)}; --shape {op.cli_shape}",
                                  description=f"Autotunes {name} (products: {', '.join(op.products)}).")
        sub.add_argument("--shape", action="append", required=True,
                         help=f"{op.cli_shape}; repeat for several shapes")
        op.add_cli_arguments(sub)
        per_op[name] = sub
    return parser, per_op


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _first_part(exc: Exception) -> str:
    """An exception's message without the C++ frames torch appends to a check's message."""
    return str(exc).split("\nException raised from", 1)[0].strip()


def main(argv=None) -> int:
    import tokamax_torch

    parser, per_op = build_parser()
    args, unknown = parser.parse_known_args(argv)
    sub = per_op[args.op]
    if unknown:
        # A flag of another op gets a message saying so, not only "unrecognized".
        flag = unknown[0].split("=", 1)[0]
        owners = [name for name, other in per_op.items() if name != args.op and flag in _flags(other)]
        if owners:
            sub.error(f"{flag} does not apply to {args.op} (it is a flag of {', '.join(owners)})")
        sub.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.reps < 1 or args.warmup < 0:
        sub.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    op = _ops()[args.op]
    products = args.products.split(",") if args.products else None
    for product in products or ():
        if product not in op.products:
            sub.error(f"--products: {args.op} has products {list(op.products)}, got {product!r}")
    for shape in args.shape:
        for dtype_name in args.dtype or ["float32"]:
            try:
                bound = op.cli_call(shape, getattr(torch, dtype_name), args)
            except (TypeError, ValueError) as exc:
                sub.error(str(exc))
            try:
                result = tokamax_torch.autotune(
                    bound, reps=args.reps, warmup=args.warmup, budget_s=args.budget_s,
                    max_configs=args.max_configs, write_cache=not args.no_write, products=products)
            except (TypeError, ValueError, RuntimeError) as exc:
                # The op's own argument checks (a shape it refuses): its message, not a traceback.
                sub.error(f"--shape {shape} ({dtype_name}): {_first_part(exc)}")
            print(f"shape {shape}, {dtype_name}")
            print(result)
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
