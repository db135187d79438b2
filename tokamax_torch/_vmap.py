"""torch.vmap for the ops: each op's batching rule, registered once by its singletons.

- An op that donates a buffer refuses vmap with an error naming the op and the buffer: the op
  writes one buffer in place, which a batched call cannot split per sample.
- Every other op runs once per sample and its results are stacked. That is what PyTorch's own
  fallback does, but the fallback warns that a batching rule is missing and asks the user to file
  a PyTorch issue about a tokamax op.

docs/design.md, "torch.vmap and torch.func", says why there are no batching rules that fold the
batch into the op's own dimensions, and why torch.func's differentiating transforms are refused.
"""

from __future__ import annotations

import functools

import torch

_registered: set[str] = set()


def register(op, donated_args: tuple[str, ...]) -> None:
    """Registers `op`'s batching rule, once per op (two singletons may share one op)."""
    name = op.name()
    if name in _registered:
        return
    _registered.add(name)
    rule = functools.partial(_refuse_donating, name, donated_args) if donated_args else functools.partial(_per_sample, op)
    torch.library.register_vmap(op, rule)


def _refuse_donating(name: str, donated_args: tuple[str, ...], info, in_dims, *args, **kwargs):
    buffers = " and ".join(donated_args)
    raise RuntimeError(f"{name}: torch.vmap is not supported: the op writes {buffers} in place (donated), which a "
                       f"batched call cannot split per sample; call the op once per sample")


def _per_sample(op, info, in_dims, *args, **kwargs):
    # in_dims holds an int for each batched tensor (a list argument gets a list of Nones).
    batched = [(a, dim) if isinstance(a, torch.Tensor) and isinstance(dim, int) else (a, None)
               for a, dim in zip(args, in_dims)]
    results = [op(*(a if dim is None else a.select(dim, i) for a, dim in batched), **kwargs)
               for i in range(info.batch_size)]
    if not isinstance(results[0], (tuple, list)):
        return torch.stack(results), 0
    # Optional outputs left out (None) stay None, unbatched.
    stacked = tuple(None if parts[0] is None else torch.stack(parts) for parts in zip(*results))
    return stacked, tuple(None if out is None else 0 for out in stacked)
