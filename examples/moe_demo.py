"""tokamax_torch in a model: a mixture-of-experts feed-forward, then a small language model.

Part 1. A mixture-of-experts feed-forward with a shared dense expert, as Qwen-MoE and DeepSeek
write it. The kernel path is two calls: ``fused_moe`` (softmax router, top-k, renormalisation,
gate-and-up product with SwiGLU, down product and the weighted combine, forward and backward) and
``gated_linear_unit`` for the dense SwiGLU expert. The reference path is what a user writes in
plain PyTorch: router and top-k, tokens sorted by expert, one grouped product per projection
(``ragged_dot``'s reference), un-sort and combine. Both run forward and backward, eagerly and
under torch.compile(fullgraph=True); they must agree, and a timing table is printed.

Part 2. A two-block pre-norm language model: token embedding; per block ``rms_norm`` with the
fused residual add before attention and before the feed-forward; grouped-query causal attention on
``dot_product_attention`` (8 query heads sharing 2 kv heads, never repeated in memory); the
Part 1 feed-forward; a final ``rms_norm`` and a language-model head trained with
``linear_softmax_cross_entropy_loss`` (the [tokens, vocab] logits never exist). Two copies with
identical weights, one on the kernels compiled with torch.compile(fullgraph=True), one eager on
the references, train for a few AdamW steps on the same batches; their losses must agree step
by step.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import tokamax_torch
from tokamax_torch.ops import dot_product_attention as dpa
from tokamax_torch.ops import gated_linear_unit as glu
from tokamax_torch.ops import layer_norm as ln
from tokamax_torch.ops import ragged_dot as rd


def plain_moe(x, w_gate_up, w_down, router_logits, top_k):
    """The MoE feed-forward in plain PyTorch on ragged_dot's reference: the reference path."""
    tokens, dim = x.shape
    num_experts = w_gate_up.shape[0]
    weights, experts = torch.topk(F.softmax(router_logits, dim=-1), top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    # Sort (token, expert) pairs by expert: expert e owns rows [sum(sizes[:e]), sum(sizes[:e+1])).
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    group_sizes = torch.bincount(flat_experts, minlength=num_experts).to(torch.int32)
    rows = x[order // top_k]
    gate, up = rd.reference(rows, w_gate_up, group_sizes).chunk(2, dim=-1)
    out_rows = rd.reference(F.silu(gate) * up, w_down, group_sizes)
    # Un-sort and combine each token's top-k expert outputs with its router weights.
    combined = torch.zeros_like(out_rows).index_copy(0, order, out_rows)
    return (combined.view(tokens, top_k, dim) * weights.unsqueeze(-1)).sum(1)


def fused_moe(x, w_gate_up, w_down, router_logits, top_k):
    return tokamax_torch.fused_moe(x, w_gate_up, w_down, router_logits, topk=top_k, renormalize=True)


def fused_lm_loss(y, labels, head_weight):
    # head_weight is nn.Linear's [vocab, dim]; its transposed view goes in without a copy.
    return tokamax_torch.linear_softmax_cross_entropy_loss(y, labels, head_weight.t(), reduction="mean")


def plain_lm_loss(y, labels, head_weight):
    return F.cross_entropy(F.linear(y, head_weight), labels)


class Ops(NamedTuple):
    """The implementations a model is built on: the kernels, or the plain-PyTorch references."""
    rms_norm: Callable
    attention: Callable
    gated_linear_unit: Callable
    moe: Callable
    lm_loss: Callable


KERNELS = Ops(tokamax_torch.rms_norm, tokamax_torch.dot_product_attention, tokamax_torch.gated_linear_unit,
              fused_moe, fused_lm_loss)
REFERENCES = Ops(ln.rms_norm_reference, dpa.reference, glu.reference, plain_moe, plain_lm_loss)


class MoEFeedForward(torch.nn.Module):
    """Routed SwiGLU experts plus one shared (dense) SwiGLU expert; x is [tokens, dim]."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, shared_hidden: int, ops: Ops) -> None:
        super().__init__()
        self.top_k, self.ops = top_k, ops
        self.router = torch.nn.Linear(dim, num_experts, bias=False)
        # Per expert [dim, 2*hidden]: the gate's columns first, then the up projection's.
        self.w_gate_up = torch.nn.Parameter(torch.randn(num_experts, dim, 2 * hidden) * dim**-0.5)
        self.w_down = torch.nn.Parameter(torch.randn(num_experts, hidden, dim) * hidden**-0.5)
        # The shared expert's fused [dim, 2, shared_hidden] (gate, up), gated_linear_unit's layout.
        self.shared_gate_up = torch.nn.Parameter(torch.randn(dim, 2, shared_hidden) * dim**-0.5)
        self.shared_down = torch.nn.Linear(shared_hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.ops.moe(x, self.w_gate_up, self.w_down, self.router(x), self.top_k)
        shared = self.shared_down(self.ops.gated_linear_unit(x, self.shared_gate_up, activation="swish"))
        return routed + shared


class TransformerBlock(torch.nn.Module):
    """Pre-norm block on a residual stream h with a pending update: h += update, then
    h += attention(norm(h)), then the feed-forward's output becomes the next pending update.
    Each add is fused into the rms_norm that follows it."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, experts: int, top_k: int, ops: Ops) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.ops = heads, kv_heads, dim // heads, ops
        self.norm1 = torch.nn.Parameter(torch.ones(dim))
        self.norm2 = torch.nn.Parameter(torch.ones(dim))
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.moe = MoEFeedForward(dim, hidden, experts, top_k, hidden, ops)

    def forward(self, h: torch.Tensor, update: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, dim = h.shape
        if update is None:
            y = self.ops.rms_norm(h, self.norm1)
        else:
            y, h = self.ops.rms_norm(update, self.norm1, residual=h)  # h = h + update, y = norm(h)
        q = self.wq(y).view(b, t, self.heads, self.head_dim)
        k, v = self.wkv(y).view(b, t, 2, self.kv_heads, self.head_dim).unbind(2)
        attended = self.wo(self.ops.attention(q, k, v, is_causal=True).reshape(b, t, dim))
        y, h = self.ops.rms_norm(attended, self.norm2, residual=h)
        return h, self.moe(y.reshape(b * t, dim)).view(b, t, dim)


class LanguageModel(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, blocks: int, ops: Ops, **block_args) -> None:
        super().__init__()
        self.ops = ops
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(TransformerBlock(dim, ops=ops, **block_args) for _ in range(blocks))
        self.final_norm = torch.nn.Parameter(torch.ones(dim))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of labels given tokens (both [B, T])."""
        h, update = self.embed(tokens), None
        for block in self.blocks:
            h, update = block(h, update)
        y, _ = self.ops.rms_norm(update, self.final_norm, residual=h)
        return self.ops.lm_loss(y.reshape(-1, y.shape[-1]), labels.reshape(-1), self.head.weight)


def train_language_model(steps: int = 5) -> None:
    torch.manual_seed(0)
    vocab, batch, seq = 512, 2, 64
    block_args = dict(heads=8, kv_heads=2, hidden=256, experts=4, top_k=2)
    kernel_model = LanguageModel(vocab, 128, 2, KERNELS, **block_args)
    reference_model = LanguageModel(vocab, 128, 2, REFERENCES, **block_args)
    reference_model.load_state_dict(kernel_model.state_dict())
    # Learn a fixed random map from each token to the next one.
    tokens = torch.randint(0, vocab, (steps, batch, seq))
    labels = torch.randperm(vocab)[tokens]
    compiled = torch.compile(kernel_model, fullgraph=True)
    print(f"\nLanguage model: vocab {vocab}, 2 blocks of dim 128, 8 query heads / 2 kv heads, MoE 4 experts "
          f"top-2 + a shared expert; B={batch}, T={seq}; {steps} AdamW steps, kernels under "
          "torch.compile(fullgraph=True) vs references in eager\n")
    print(f"{'step':<6}{'kernel loss':>14}{'reference loss':>16}{'rel. diff':>11}")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (kernel_model, reference_model)]
    for step in range(steps):
        losses = []
        for model, optimizer in zip((compiled, reference_model), optimizers):
            optimizer.zero_grad(set_to_none=True)
            loss = model(tokens[step], labels[step])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        diff = abs(losses[0] - losses[1]) / abs(losses[1])
        print(f"{step:<6}{losses[0]:>14.6f}{losses[1]:>16.6f}{diff:>11.1e}")
        # fp32 kernels and references differ by rounding only; AdamW amplifies it a little per step.
        # Written so that a NaN loss fails too.
        if not diff <= 1e-4:
            raise SystemExit(f"step {step}: kernel loss {losses[0]} differs from reference loss {losses[1]}")
    print("losses agree at every step (rel. diff <= 1e-4)")


def timed(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    torch.manual_seed(0)
    tokens, dim, hidden, experts, top_k = 1024, 256, 512, 8, 2
    kernel_block = MoEFeedForward(dim, hidden, experts, top_k, hidden, KERNELS)
    reference_block = MoEFeedForward(dim, hidden, experts, top_k, hidden, REFERENCES)
    reference_block.load_state_dict(kernel_block.state_dict())
    x = torch.randn(tokens, dim)
    print(f"MoE feed-forward: {tokens} tokens, dim {dim}, hidden {hidden}, {experts} experts top-{top_k} "
          f"+ a shared expert; {tokamax_torch.device_kind()}, {torch.get_num_threads()} threads\n")

    def fwd_bwd(block):
        def run():
            block.zero_grad(set_to_none=True)
            out = block(x)
            out.square().mean().backward()
            return out
        return run

    results = {}
    for name, block in (("kernel", kernel_block), ("reference", reference_block)):
        eager = fwd_bwd(block)
        compiled_block = torch.compile(block, fullgraph=True)
        compiled = fwd_bwd(compiled_block)
        out_eager = eager().detach()
        grads_eager = [p.grad.clone() for p in block.parameters()]
        out_compiled = compiled().detach()
        grads_compiled = [p.grad.clone() for p in block.parameters()]
        torch.testing.assert_close(out_compiled, out_eager, rtol=1e-4, atol=1e-5)
        for a, b in zip(grads_compiled, grads_eager):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            fwd_ms = timed(lambda: block(x))
        results[name] = dict(out=out_eager, grads=grads_eager, fwd=fwd_ms, fwd_bwd=timed(eager),
                             compiled=timed(compiled))

    k, r = results["kernel"], results["reference"]
    torch.testing.assert_close(k["out"], r["out"], rtol=1e-4, atol=1e-5)
    for a, b in zip(k["grads"], r["grads"]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    out_err = ((k["out"] - r["out"]).abs().max() / r["out"].abs().max()).item()
    grad_err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(k["grads"], r["grads"]))
    print(f"kernel vs reference: output rel. error {out_err:.1e}, gradient rel. error {grad_err:.1e}; "
          "compiled == eager for both\n")
    print(f"{'mode':<34}{'kernel ms':>11}{'reference ms':>14}{'speed-up':>10}")
    for label, key in (("eager forward", "fwd"), ("eager forward+backward", "fwd_bwd"),
                       ("torch.compile forward+backward", "compiled")):
        print(f"{label:<34}{k[key]:>11.2f}{r[key]:>14.2f}{r[key] / k[key]:>9.2f}x")


if __name__ == "__main__":
    main()
    train_language_model()
