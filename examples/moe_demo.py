"""tokamax_torch in a model: a mixture-of-experts feed-forward, then a whole transformer block.

Part 1. Router and top-k in plain PyTorch; tokens are sorted by expert so each expert owns a
contiguous block of rows, and both expert projections are one ragged_dot each. The block runs
forward and backward, eagerly and under torch.compile(fullgraph=True), with the kernel and
with the reference, checks they agree, and prints a timing table.

Part 2. A pre-norm transformer block: grouped-query causal self-attention on
dot_product_attention (8 query heads sharing 2 kv heads, never repeated in memory), then the
MoE feed-forward, each with a residual. Two copies with identical weights, one on the kernels
and compiled with torch.compile(fullgraph=True), one eager on the references, train for a few
AdamW steps on the same batches; their losses must agree step by step.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import tokamax_torch
from tokamax_torch.ops import dot_product_attention as dpa
from tokamax_torch.ops import ragged_dot as rd


class MoEFeedForward(torch.nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, ragged_dot) -> None:
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.ragged_dot = ragged_dot
        self.router = torch.nn.Linear(dim, num_experts, bias=False)
        self.w_gate_up = torch.nn.Parameter(torch.randn(num_experts, dim, 2 * hidden) * dim**-0.5)
        self.w_down = torch.nn.Parameter(torch.randn(num_experts, hidden, dim) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, dim = x.shape
        weights, experts = torch.topk(F.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        # Sort (token, expert) pairs by expert: expert e owns rows [sum(sizes[:e]), sum(sizes[:e+1])).
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        group_sizes = torch.bincount(flat_experts, minlength=self.num_experts).to(torch.int32)
        rows = x[order // self.top_k]
        gate, up = self.ragged_dot(rows, self.w_gate_up, group_sizes).chunk(2, dim=-1)
        out_rows = self.ragged_dot(F.silu(gate) * up, self.w_down, group_sizes)
        # Un-sort and combine each token's top-k expert outputs with its router weights.
        combined = torch.zeros_like(out_rows).index_copy(0, order, out_rows)
        return (combined.view(tokens, self.top_k, dim) * weights.unsqueeze(-1)).sum(1)


class TransformerBlock(torch.nn.Module):
    """x + attention(norm(x)), then + moe(norm(.)); x is [B, T, dim]."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, experts: int, top_k: int, attention,
                 ragged_dot) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention = attention
        self.norm1 = torch.nn.RMSNorm(dim)
        self.norm2 = torch.nn.RMSNorm(dim)
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.moe = MoEFeedForward(dim, hidden, experts, top_k, ragged_dot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, dim = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim)
        k, v = self.wkv(h).view(b, t, 2, self.kv_heads, self.head_dim).unbind(2)
        x = x + self.wo(self.attention(q, k, v, is_causal=True).reshape(b, t, dim))
        return x + self.moe(self.norm2(x).reshape(b * t, dim)).view(b, t, dim)


def train_transformer_block() -> None:
    torch.manual_seed(0)
    batch, seq, dim, heads, kv_heads, hidden, experts, top_k, steps = 2, 64, 128, 8, 2, 256, 4, 2, 5
    kernel_block = TransformerBlock(dim, heads, kv_heads, hidden, experts, top_k, tokamax_torch.dot_product_attention,
                                    tokamax_torch.ragged_dot)
    reference_block = TransformerBlock(dim, heads, kv_heads, hidden, experts, top_k, dpa.reference, rd.reference)
    reference_block.load_state_dict(kernel_block.state_dict())
    # Learn to map random sequences to a fixed random transform of themselves.
    inputs = torch.randn(steps, batch, seq, dim)
    targets = torch.tanh(inputs @ torch.randn(dim, dim) * dim**-0.5)
    compiled = torch.compile(kernel_block, fullgraph=True)
    print(f"\nTransformer block: B={batch}, T={seq}, dim {dim}, {heads} query heads / {kv_heads} kv heads, "
          f"MoE {experts} experts top-{top_k}; {steps} AdamW steps, kernels under torch.compile(fullgraph=True) "
          "vs references in eager\n")
    print(f"{'step':<6}{'kernel loss':>14}{'reference loss':>16}{'rel. diff':>11}")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (kernel_block, reference_block)]
    for step in range(steps):
        losses = []
        for model, optimizer in zip((compiled, reference_block), optimizers):
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(inputs[step]), targets[step])
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
    kernel_block = MoEFeedForward(dim, hidden, experts, top_k, tokamax_torch.ragged_dot)
    reference_block = MoEFeedForward(dim, hidden, experts, top_k, rd.reference)
    reference_block.load_state_dict(kernel_block.state_dict())
    x = torch.randn(tokens, dim)
    print(f"MoE feed-forward: {tokens} tokens, dim {dim}, hidden {hidden}, {experts} experts, top-{top_k}; "
          f"{tokamax_torch.device_kind()}, {torch.get_num_threads()} threads\n")

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
    train_transformer_block()
