"""One fresh process of the repro of issue 18 (shared/repro/attention_after_backward.py), with
seeded inputs of the repro's shapes: the kernel's forward and backward, then the reference's
forward under autograd, whose first softmax is the process's first parallel exp. Prints the
relative error against float64 and exits 1 when it is over 1e-5 (a correct run gives ~3e-7; the
oneMKL VML first-call race gave ~4e-5)."""
import sys

import torch

import tokamax_torch
from tokamax_torch.ops import dot_product_attention as dpa

generator = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
shapes = {"q": (1, 130, 8, 64), "k": (1, 130, 2, 64), "v": (1, 130, 2, 64), "cot": (1, 130, 8, 64)}
data = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def run(attention):
    q, k, v = (data[name].clone().requires_grad_() for name in "qkv")
    out = attention(q, k, v, is_causal=True)
    (out * data["cot"]).sum().backward()
    return out.detach()


run(tokamax_torch.dot_product_attention)
out = run(dpa.reference)
want = dpa.reference(*(data[name].double() for name in "qkv"), is_causal=True)
error = float((out.double() - want).abs().max() / want.abs().max())
print(f"{error:.2e}")
sys.exit(0 if error < 1e-5 else 1)
