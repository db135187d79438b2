"""A Hugging Face transformers Qwen3-MoE-style model trained and generating on tokamax ops.

A small Qwen3-MoE (random weights from its config, nothing downloaded) is trained for a few
AdamW steps on a next-token rule three times from the same initial weights and batches: with
transformers' ``eager`` backends (the matmul-softmax attention, the loop over experts), with
its CPU defaults (``sdpa`` attention, ``grouped_mm`` experts) and with the ``"tokamax"``
backends that ``tokamax_torch.integrations.transformers.apply(model)`` sets (attention on
``dot_product_attention``, experts on ``fused_experts``). The tokamax losses must match the
eager ones step by step. Then the eager-trained model generates greedily with each backend; the
tokamax tokens must be the eager ones. A table gives the time of each.

    python examples/hf_moe.py [--steps 10] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import transformers

import tokamax_torch  # noqa: F401  (loads the ops)
from tokamax_torch.integrations import transformers as tokamax_hf

#: label -> (attn_implementation, experts_implementation); None means apply(model).
BACKENDS = {"eager": ("eager", "eager"), "sdpa + grouped_mm": ("sdpa", "grouped_mm"), "tokamax": None}


def build_model(dtype: torch.dtype) -> transformers.PreTrainedModel:
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def use_backend(model, label: str):
    if BACKENDS[label] is None:
        return tokamax_hf.apply(model)  # the one-liner: attention and experts on tokamax ops
    attention, experts = BACKENDS[label]
    model.set_attn_implementation(attention)
    model.set_experts_implementation(experts)
    return model


def rule_batches(steps: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    """Sequences from random starts following t[i+1] = (5 t[i] + 7) mod vocab: a rule a few
    steps already learn, so the loss visibly falls."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        tokens = [torch.randint(0, vocab, (batch,), generator=generator)]
        for _ in range(seq - 1):
            tokens.append((5 * tokens[-1] + 7) % vocab)
        batches.append(torch.stack(tokens, dim=1))
    return batches


def train(model, batches) -> tuple[list[float], list[float]]:
    """Losses and the seconds of each step (forward, backward, AdamW)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, seconds = [], []
    for ids in batches:
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, seconds


@torch.no_grad()
def generate(model, prompts, mask, new_tokens: int) -> tuple[torch.Tensor, float]:
    model.eval()
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    model.generate(prompts, **dict(kwargs, max_new_tokens=2))  # warm-up
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        tokens = model.generate(prompts, **kwargs)
        best = min(best, time.perf_counter() - start)
    return tokens, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    initial = build_model(dtype)
    cfg = initial.config
    print(f"Qwen3-MoE-style model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} query/kv heads, {cfg.num_experts} experts "
          f"top-{cfg.num_experts_per_tok} (I={cfg.moe_intermediate_size}), {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    batches = rule_batches(args.steps, args.batch, args.seq, cfg.vocab_size)
    print(f"training: {args.steps} AdamW steps on [{args.batch}, {args.seq}] batches of a next-token rule\n")

    losses, step_ms, trained = {}, {}, {}
    for label in BACKENDS:
        model = use_backend(copy.deepcopy(initial), label)
        losses[label], seconds = train(model, batches)
        step_ms[label] = 1e3 * statistics.median(seconds[1:] or seconds)  # the first step warms up
        trained[label] = model
    def rel(label, step):
        return abs(losses[label][step] - losses["eager"][step]) / abs(losses["eager"][step])

    print(f"{'step':<6}" + "".join(f"{label + ' loss':>24}" for label in BACKENDS) +
          "".join(f"{label + ' rel. diff':>29}" for label in list(BACKENDS)[1:]))
    for step in range(args.steps):
        print(f"{step:<6}" + "".join(f"{losses[label][step]:>24.6f}" for label in BACKENDS) +
              "".join(f"{rel(label, step):>29.1e}" for label in list(BACKENDS)[1:]))
    # AdamW's normalisation magnifies rounding-order differences step by step; transformers' own
    # two backends drift apart by the same order.
    loss_tol = 1e-3 if dtype == torch.float32 else 3e-2
    worst = max(rel("tokamax", step) for step in range(args.steps))
    if worst > loss_tol:
        raise SystemExit(f"tokamax losses differ from eager by {worst:.1e} > {loss_tol:.0e}")
    print(f"tokamax losses match eager at every step (rel. diff <= {loss_tol:.0e})\n")

    # Greedy generation with each backend from the same (eager-trained) weights; the second
    # prompt is left-padded, as generate pads a batch, so the padding mask goes through the ops.
    model = trained["eager"]
    prompts = batches[0][:4, :24].clone()
    mask = torch.ones_like(prompts)
    mask[1, :5] = 0
    tokens, gen_s = {}, {}
    for label in BACKENDS:
        tokens[label], gen_s[label] = generate(use_backend(model, label), prompts, mask, args.new_tokens)
    same = torch.equal(tokens["tokamax"], tokens["eager"])
    print(f"greedy generation, {prompts.shape[0]} prompts of {prompts.shape[1]} tokens + {args.new_tokens} new: "
          f"tokamax tokens {'==' if same else '!='} eager tokens")
    generated = tokens["tokamax"][:, prompts.shape[1]:]
    expected = (5 * torch.cat([prompts[:, -1:], generated[:, :-1]], dim=1) + 7) % cfg.vocab_size
    print(f"generated tokens that follow the rule: {(generated == expected).float().mean().item():.0%}")
    if not same and dtype == torch.float32:
        raise SystemExit("tokamax generated other tokens than eager")

    new = prompts.shape[0] * args.new_tokens
    print(f"\n{'':<34}" + "".join(f"{label:>19}" for label in BACKENDS) + f"{'tokamax vs eager':>18}"
          f"{'vs sdpa+gmm':>13}")
    rows = [("train step (fwd+bwd+AdamW), ms", step_ms), ("generate, ms", {k: 1e3 * v for k, v in gen_s.items()})]
    for name, values in rows:
        print(f"{name:<34}" + "".join(f"{values[label]:>19.1f}" for label in BACKENDS) +
              f"{values['eager'] / values['tokamax']:>17.2f}x{values['sdpa + grouped_mm'] / values['tokamax']:>12.2f}x")
    print(f"{'generate, new tokens/s':<34}" + "".join(f"{new / gen_s[label]:>19.1f}" for label in BACKENDS))


if __name__ == "__main__":
    main()
