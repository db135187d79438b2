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
    if name.split("::")[0] in ("aten", "prims"):  # PyTorch's own ops keep their batching rules
        raise ValueError(f"batching rules are registered for custom ops only, got {name}")
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
    batched = []
    for a, dim in zip(args, in_dims):
        if isinstance(dim, (list, tuple)) and any(d is not None for d in dim):
            # A list of tensors would need each element split; no schema has one today.
            raise RuntimeError(f"{op.name()}: torch.vmap over a list argument is not supported")
        batched.append((a, dim if isinstance(dim, int) else None))
    if info.batch_size == 0:
        return _empty_batch(op, batched, kwargs)
    results = [op(*(a if dim is None else a.select(dim, i) for a, dim in batched), **kwargs)
               for i in range(info.batch_size)]
    if isinstance(results[0], (tuple, list)):
        return tuple(torch.stack(parts) for parts in zip(*results)), (0,) * len(results[0])
    return torch.stack(results), 0


def _empty_batch(op, batched, kwargs):
    """An empty batch: the outputs' shapes from one sample run on the meta device (the op's
    checks included), each with a leading batch dimension of 0."""
    def sample(a, dim):
        if dim is None:
            return a.to("meta") if isinstance(a, torch.Tensor) else a
        return torch.empty(a.shape[:dim] + a.shape[dim + 1:], dtype=a.dtype, device="meta")
    device = next(a.device for a, dim in batched if dim is not None)
    shapes = op(*(sample(a, dim) for a, dim in batched),
                **{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    empty = lambda r: torch.empty((0, *r.shape), dtype=r.dtype, device=device)  # noqa: E731
    if isinstance(shapes, (tuple, list)):
        return tuple(empty(r) for r in shapes), (0,) * len(shapes)
    return empty(shapes), 0
