"""Serving a small language model from a paged KV cache with continuous batching.

A decoder-only model with random weights (RMSNorm through ``tokamax_torch.rms_norm``, rotary
positions, grouped-query attention through ``tokamax_torch.ragged_paged_attention``, a SwiGLU
feed-forward) serves a dozen requests of different prompt lengths. Each step the scheduler packs
one token of every decoding request and chunks of waiting prompts (up to a token budget) into one
ragged batch: decode sequences first, then first prompt chunks (prefill), then later prompt
chunks (mixed: new tokens after cached ones), which is the order of the op's ``distribution``.
Requests that finish return their pages to the free list and waiting ones join; a request is
admitted only when the free pages cover its whole length, so nobody is ever preempted.

The KV cache of each layer is ``[total_pages, page_size, 2 * Hkv, D]`` (merged head 2h is K of
head h, 2h + 1 its V). It is donated: the op writes the step's new keys and values into it and
returns it, the same storage. One step is one ``torch.compile(fullgraph=True, dynamic=True)``
graph; token counts are padded to multiples of 8 (padding tokens lie past
``cu_q_lens[distribution[2]]``, so the op neither writes nor attends for them), the batch has a
fixed number of sequence slots, and after a one-request warm-up the demo serves everything with
recompilation made an error.

Checks: every request's greedy tokens equal those of a plain generation of the same model, one
request at a time with a contiguous KV cache and SDPA. Prints tokens/s of the paged engine, of
the plain model, and of the same engine with attention written as a user would without the op
(write the new rows with ``index_copy_``, gather each sequence's pages with ``index_select``,
then SDPA).

    python examples/serve_demo.py
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
import torch.nn.functional as F

import tokamax_torch


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 2048
    dim: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    hidden: int = 1024
    max_context: int = 768
    eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    requests: int = 12
    prompt_lens: tuple[int, int] = (16, 512)  # drawn uniformly in [lo, hi]
    new_tokens: tuple[int, int] = (32, 128)
    max_seqs: int = 8  # sequence slots per step
    token_budget: int = 128  # tokens per step (decode tokens + prompt chunks)
    page_size: int = 16
    total_pages: int = 224  # fewer than all requests need together: pages are reused
    timed_runs: int = 2  # everything is served this many times (engines: after warm-up); the fastest counts
    seed: int = 0


class TinyLM(torch.nn.Module):
    """Pre-norm decoder with random weights. ``forward`` takes a flat list of tokens and leaves
    attention to ``attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]``."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * scale, requires_grad=False)

        c = cfg
        qkv = (c.heads + 2 * c.kv_heads) * c.head_dim
        self.embed = w(c.vocab, c.dim, scale=1.0)
        self.wqkv = torch.nn.ParameterList([w(qkv, c.dim, scale=c.dim**-0.5) for _ in range(c.layers)])
        self.wo = torch.nn.ParameterList([w(c.dim, c.heads * c.head_dim, scale=(c.heads * c.head_dim)**-0.5)
                                          for _ in range(c.layers)])
        self.w_gate_up = torch.nn.ParameterList([w(2 * c.hidden, c.dim, scale=c.dim**-0.5) for _ in range(c.layers)])
        self.w_down = torch.nn.ParameterList([w(c.dim, c.hidden, scale=c.hidden**-0.5) for _ in range(c.layers)])
        self.attn_norm = torch.nn.ParameterList([w(c.dim, scale=0.1) for _ in range(c.layers)])
        self.mlp_norm = torch.nn.ParameterList([w(c.dim, scale=0.1) for _ in range(c.layers)])
        self.final_norm = w(c.dim, scale=0.1)
        self.lm_head = w(c.vocab, c.dim, scale=c.dim**-0.5)
        with torch.no_grad():
            for p in (*self.attn_norm, *self.mlp_norm, self.final_norm):
                p.add_(1.0)
        inv_freq = 1.0 / (10000.0**(torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        angles = torch.arange(c.max_context, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Callable) -> torch.Tensor:
        """tokens, positions [T] -> hidden states [T, dim] (before the final norm)."""
        c = self.cfg
        t = tokens.shape[0]
        cos = self.rope_cos[positions][:, None, :]
        sin = self.rope_sin[positions][:, None, :]
        x = self.embed[tokens]
        for layer in range(c.layers):
            h = tokamax_torch.rms_norm(x, self.attn_norm[layer], epsilon=c.eps)
            q, k, v = F.linear(h, self.wqkv[layer]).view(t, c.heads + 2 * c.kv_heads, c.head_dim).split(
                [c.heads, c.kv_heads, c.kv_heads], dim=1)
            o = attend(layer, self._rope(q, cos, sin), self._rope(k, cos, sin), v.contiguous())
            x = x + F.linear(o.reshape(t, c.heads * c.head_dim), self.wo[layer])
            h = tokamax_torch.rms_norm(x, self.mlp_norm[layer], epsilon=c.eps)
            gate, up = F.linear(h, self.w_gate_up[layer]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, self.w_down[layer])
        return x

    def next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy next token of each row of hidden [N, dim]."""
        h = tokamax_torch.rms_norm(hidden, self.final_norm, epsilon=self.cfg.eps)
        return F.linear(h, self.lm_head).argmax(-1)


# ---- requests, pages and the scheduler ----------------------------------------------------------


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new: int
    generated: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are in the cache
    pages: list[int] = dataclasses.field(default_factory=list)

    @property
    def length(self) -> int:  # every token the request will ever hold in the cache
        return len(self.prompt) + self.max_new - 1

    @property
    def done(self) -> bool:
        return len(self.generated) == self.max_new


def make_requests(cfg: ServeConfig, vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    out = []
    for rid in range(cfg.requests):
        n = int(torch.randint(cfg.prompt_lens[0], cfg.prompt_lens[1] + 1, (), generator=g))
        m = int(torch.randint(cfg.new_tokens[0], cfg.new_tokens[1] + 1, (), generator=g))
        out.append(Request(rid, torch.randint(0, vocab, (n,), generator=g).tolist(), m))
    return out


@dataclasses.dataclass
class Batch:
    """One step's ragged batch, as the op takes it, plus what the gather baseline needs."""
    requests: list[Request]
    q_lens: list[int]
    tokens: torch.Tensor  # [T] int64, padded to a multiple of 8
    positions: torch.Tensor  # [T] int64
    kv_lens: torch.Tensor  # [max_seqs] int32, cache length including this step's tokens
    page_indices: torch.Tensor  # [max_seqs * pages_per_seq] int32
    cu_q_lens: torch.Tensor  # [max_seqs + 1] int32
    distribution: torch.Tensor  # [3] int32: cumulative counts of decode, prefill, mixed sequences
    slots: torch.Tensor  # [T] int64 cache row of each token; padding -> the baseline's spare page
    seq_ids: torch.Tensor  # [T] int64 batch slot of each token (padding -> max_seqs)
    q_pos: torch.Tensor  # [T] int64 index of each token within its sequence's new tokens
    q_max: torch.Tensor  # [max(2, longest q_len)]: the size is what counts
    kv_pages: torch.Tensor  # [max(2, most pages of a sequence)]: the size is what counts


class Scheduler:
    """Continuous batching over a page free list."""

    def __init__(self, requests: list[Request], cfg: ServeConfig, model_cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.pages_per_seq = model_cfg.max_context // cfg.page_size
        self.waiting = list(requests)
        self.running: list[Request] = []
        self.free_pages = list(range(cfg.total_pages))
        self.pages_taken = 0
        self.finished_count = 0
        for r in requests:
            if r.length > model_cfg.max_context:
                raise ValueError(f"request {r.rid}: {r.length} tokens exceed the context of {model_cfg.max_context}")

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.cfg.page_size)

    def finished(self) -> bool:
        return not self.waiting and not self.running

    def _admit(self) -> None:
        # Pages still owed to running requests are spoken for: admission never leads to preemption.
        owed = sum(self._pages(r.length) - len(r.pages) for r in self.running)
        while self.waiting and len(self.running) < self.cfg.max_seqs:
            need = self._pages(self.waiting[0].length)
            if len(self.free_pages) - owed < need:
                break
            owed += need
            self.running.append(self.waiting.pop(0))

    def schedule(self) -> Batch:
        self._admit()
        budget = self.cfg.token_budget
        decode = [r for r in self.running if r.computed >= len(r.prompt)]
        budget -= len(decode)
        prefill, mixed = [], []
        chunks = {}
        for r in self.running:
            if r.computed < len(r.prompt) and budget > 0:
                chunks[r.rid] = min(len(r.prompt) - r.computed, budget)
                budget -= chunks[r.rid]
                (prefill if r.computed == 0 else mixed).append(r)
        seqs = decode + prefill + mixed
        if not seqs:
            raise ValueError(f"request {self.waiting[0].rid} needs more pages than the cache has")
        c, ps, pps = self.cfg, self.cfg.page_size, self.pages_per_seq
        tokens, positions, slots, seq_ids, q_pos, q_lens = [], [], [], [], [], []
        kv_lens = [0] * c.max_seqs
        page_indices = [0] * (c.max_seqs * pps)
        for i, r in enumerate(seqs):
            if r.rid in chunks:
                new = r.prompt[r.computed:r.computed + chunks[r.rid]]
            else:
                new = r.generated[-1:]
            kv_len = r.computed + len(new)
            while len(r.pages) < self._pages(kv_len):
                r.pages.append(self.free_pages.pop())
                self.pages_taken += 1
            kv_lens[i] = kv_len
            page_indices[i * pps:i * pps + len(r.pages)] = r.pages
            for j, tok in enumerate(new):
                p = r.computed + j
                tokens.append(tok)
                positions.append(p)
                slots.append(r.pages[p // ps] * ps + p % ps)
                seq_ids.append(i)
                q_pos.append(j)
            q_lens.append(len(new))
        # Padding to a multiple of 8 keeps the token count >= 2: torch.compile specializes sizes 0
        # and 1, so a lone decode token would compile a second graph.
        pad = -len(tokens) % 8
        spare = c.total_pages * ps  # the first row of the gather baseline's spare page
        tokens += [0] * pad
        positions += [0] * pad
        slots += [spare] * pad
        seq_ids += [c.max_seqs] * pad
        q_pos += [0] * pad
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        cu += [cu[-1]] * (c.max_seqs - len(seqs))
        i32 = dict(dtype=torch.int32)
        i64 = dict(dtype=torch.int64)
        batch = Batch(
            requests=seqs, q_lens=q_lens, tokens=torch.tensor(tokens, **i64), positions=torch.tensor(positions, **i64),
            kv_lens=torch.tensor(kv_lens, **i32), page_indices=torch.tensor(page_indices, **i32),
            cu_q_lens=torch.tensor(cu, **i32),
            distribution=torch.tensor([len(decode), len(decode) + len(prefill), len(seqs)], **i32),
            slots=torch.tensor(slots, **i64), seq_ids=torch.tensor(seq_ids, **i64), q_pos=torch.tensor(q_pos, **i64),
            q_max=torch.empty(max(2, max(q_lens))), kv_pages=torch.empty(max(2, max(len(r.pages) for r in seqs))))
        # Fixed sizes: static, so no size of theirs is ever equated with a token count (duck sizing).
        for t in (batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.distribution):
            torch._dynamo.mark_static(t)
        return batch

    def update(self, batch: Batch, next_tokens: torch.Tensor) -> None:
        next_tokens = next_tokens.tolist()
        for i, (r, q) in enumerate(zip(batch.requests, batch.q_lens)):
            r.computed += q
            if r.computed == len(r.prompt) + len(r.generated):  # caught up: its last token was fed
                r.generated.append(next_tokens[i])
        for r in [r for r in self.running if r.done]:
            self.finished_count += 1
            self.running.remove(r)
            self.free_pages.extend(r.pages)
            r.pages = []


# ---- the engines: one compiled step each --------------------------------------------------------


class PagedEngine:
    """The step on ``tokamax_torch.ragged_paged_attention``; the caches are donated to it."""

    name = "paged (tokamax)"

    def __init__(self, model: TinyLM, cfg: ServeConfig) -> None:
        m = model.cfg
        self.model = model
        self.caches = [torch.zeros(cfg.total_pages, cfg.page_size, 2 * m.kv_heads, m.head_dim)
                       for _ in range(m.layers)]
        for cache in self.caches:
            torch._dynamo.mark_static(cache)
        self.step = torch.compile(self._step, fullgraph=True, dynamic=True)

    def _step(self, tokens, positions, caches, kv_lens, page_indices, cu_q_lens, distribution):
        new_caches = []
        scale = self.model.cfg.head_dim**-0.5

        def attend(layer, q, k, v):
            out, cache = tokamax_torch.ragged_paged_attention(q, k, v, caches[layer], kv_lens, page_indices, cu_q_lens,
                                                              distribution, sm_scale=scale)
            new_caches.append(cache)
            return out

        hidden = self.model(tokens, positions, attend)
        last = (cu_q_lens[1:] - 1).clamp(min=0)  # each sequence's last new token
        return self.model.next_tokens(hidden[last]), new_caches

    def __call__(self, b: Batch) -> torch.Tensor:
        next_tokens, caches = self.step(b.tokens, b.positions, self.caches, b.kv_lens, b.page_indices, b.cu_q_lens,
                                        b.distribution)
        # Donation: the op handed back the very storage it was given.
        if any(new.data_ptr() != old.data_ptr() for new, old in zip(caches, self.caches)):
            raise SystemExit("ragged_paged_attention returned a KV cache in new storage: it was not donated")
        self.caches = caches
        return next_tokens


class GatherEngine:
    """The same step without the op: the new rows written with ``index_copy_`` (padding tokens to
    a spare page), each sequence's pages gathered with ``index_select``, the queries padded to
    [sequences, longest, Hq, D], then SDPA with a mask."""

    name = "gather + SDPA"

    def __init__(self, model: TinyLM, cfg: ServeConfig) -> None:
        m = model.cfg
        self.model, self.cfg = model, cfg
        self.pages_per_seq = m.max_context // cfg.page_size
        self.caches = [torch.zeros(cfg.total_pages + 1, cfg.page_size, 2 * m.kv_heads, m.head_dim)
                       for _ in range(m.layers)]
        for cache in self.caches:
            torch._dynamo.mark_static(cache)
        self.step = torch.compile(self._step, fullgraph=True, dynamic=True)

    def _step(self, tokens, positions, caches, kv_lens, page_indices, cu_q_lens, slots, seq_ids, q_pos, q_max,
              kv_pages):
        m, ps = self.model.cfg, self.cfg.page_size
        s = kv_lens.shape[0]
        n_pages, q_len_max = kv_pages.shape[0], q_max.shape[0]
        length = n_pages * ps
        table = page_indices.view(s, -1)[:, :n_pages].reshape(-1)
        q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).long()
        # Query i of sequence s sits at cache position kv_len - q_len + i. Key 0 is always let
        # through so that the empty sequence slots get no all-masked row (NaN); their rows are dropped.
        query_at = (kv_lens.long() - q_lens)[:, None] + torch.arange(q_len_max)[None, :]
        key = torch.arange(length)
        mask = (key[None, None, :] <= query_at[:, :, None]) & (key[None, None, :] < kv_lens[:, None, None])
        mask = (mask | (key == 0)).unsqueeze(1)  # [S, 1, q_len_max, length]

        def attend(layer, q, k, v):
            t = q.shape[0]
            cache = caches[layer]
            rows = cache.view(-1, 2 * m.kv_heads, m.head_dim)
            rows.index_copy_(0, slots, torch.stack([k, v], dim=2).reshape(t, 2 * m.kv_heads, m.head_dim))
            kv = cache.index_select(0, table).view(s, length, m.kv_heads, 2, m.head_dim)
            keys, values = kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)
            padded = q.new_zeros(s + 1, q_len_max, m.heads, m.head_dim)
            padded[seq_ids, q_pos] = q
            out = F.scaled_dot_product_attention(padded[:s].transpose(1, 2), keys, values, attn_mask=mask,
                                                 enable_gqa=True)
            out = F.pad(out.transpose(1, 2), (0, 0, 0, 0, 0, 0, 0, 1))  # a zero row for the padding tokens
            return out[seq_ids, q_pos]

        hidden = self.model(tokens, positions, attend)
        last = (cu_q_lens[1:] - 1).clamp(min=0)
        return self.model.next_tokens(hidden[last])

    def __call__(self, b: Batch) -> torch.Tensor:
        return self.step(b.tokens, b.positions, self.caches, b.kv_lens, b.page_indices, b.cu_q_lens, b.slots,
                         b.seq_ids, b.q_pos, b.q_max, b.kv_pages)


def serve(engine, requests: list[Request], cfg: ServeConfig, model_cfg: ModelConfig) -> dict:
    """Runs the requests to completion; returns what the steps looked like."""
    sched = Scheduler(requests, cfg, model_cfg)
    stats = dict(steps=0, decode_only=0, mixed_kinds=0, joined_late=0)
    seen = set()
    while not sched.finished():
        batch = sched.schedule()
        decode, prefill, total = batch.distribution.tolist()
        stats["decode_only"] += decode == total
        stats["mixed_kinds"] += (decode > 0) + (prefill > decode) + (total > prefill) >= 2
        # A request that starts after another one has finished took the place it left.
        stats["joined_late"] += sum(r.rid not in seen for r in batch.requests) if sched.finished_count else 0
        seen.update(r.rid for r in batch.requests)
        sched.update(batch, engine(batch))
        stats["steps"] += 1
    if sorted(sched.free_pages) != list(range(cfg.total_pages)):
        raise SystemExit("pages leaked: the free list does not hold every page after serving")
    stats["pages_taken"] = sched.pages_taken
    return stats


# ---- the plain model: one request at a time, contiguous KV cache ------------------------------


def plain_generate(model: TinyLM, prompt: list[int], max_new: int) -> list[int]:
    m = model.cfg
    length = len(prompt) + max_new - 1
    k_cache = [torch.zeros(1, m.kv_heads, length, m.head_dim) for _ in range(m.layers)]
    v_cache = [torch.zeros(1, m.kv_heads, length, m.head_dim) for _ in range(m.layers)]
    start = 0

    def attend(layer, q, k, v):
        t = q.shape[0]
        k_cache[layer][0, :, start:start + t] = k.transpose(0, 1)
        v_cache[layer][0, :, start:start + t] = v.transpose(0, 1)
        # A whole prompt (causal) or one new token (sees everything before it).
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_cache[layer][:, :, :start + t],
                                             v_cache[layer][:, :, :start + t], is_causal=start == 0 and t > 1,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)

    generated = []
    tokens = torch.tensor(prompt)
    while True:
        hidden = model(tokens, torch.arange(start, start + tokens.shape[0]), attend)
        generated.append(int(model.next_tokens(hidden[-1:])[0]))
        start += tokens.shape[0]
        if len(generated) == max_new:
            return generated
        tokens = torch.tensor(generated[-1:])


# ---- the demo -----------------------------------------------------------------------------------


def fresh(requests: list[Request]) -> list[Request]:
    return [Request(r.rid, list(r.prompt), r.max_new) for r in requests]


def run(model_cfg: ModelConfig = ModelConfig(), cfg: ServeConfig = ServeConfig(), verbose: bool = True) -> dict:
    """Serves the requests with both engines and the plain model. Raises SystemExit when a
    request's tokens differ from the plain model's or a step compiles again after warm-up.
    Returns, per engine, the seconds, tokens/s, graphs compiled in warm-up and step statistics."""
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    log = print if verbose else (lambda *a, **k: None)
    model = TinyLM(model_cfg, seed=cfg.seed).eval()
    requests = make_requests(cfg, model_cfg.vocab)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    new_tokens = sum(r.max_new for r in requests)
    log(f"{len(requests)} requests, prompts of {min(len(r.prompt) for r in requests)}-"
        f"{max(len(r.prompt) for r in requests)} tokens ({prompt_tokens} in all), {new_tokens} tokens to generate; "
        f"model: {model_cfg.layers} layers, dim {model_cfg.dim}, {model_cfg.heads} query / {model_cfg.kv_heads} kv "
        f"heads of {model_cfg.head_dim}, vocab {model_cfg.vocab}, fp32")
    log(f"paged KV cache: {cfg.total_pages} pages of {cfg.page_size} tokens per layer, up to {cfg.max_seqs} sequences "
        f"and {cfg.token_budget} tokens per step; {tokamax_torch.device_kind()}, {torch.get_num_threads()} threads\n")

    results = {}
    counters = torch._dynamo.utils.counters["stats"]
    with torch.inference_mode():
        seconds = float("inf")
        for _ in range(cfg.timed_runs):
            t0 = time.perf_counter()
            expected = {r.rid: plain_generate(model, r.prompt, r.max_new) for r in requests}
            seconds = min(seconds, time.perf_counter() - t0)
        results["plain (one request at a time, SDPA)"] = dict(seconds=seconds)
        for engine_cls in (PagedEngine, GatherEngine):
            engine = engine_cls(model, cfg)
            graphs = counters["unique_graphs"]
            t0 = time.perf_counter()
            serve(engine, [Request(-1, requests[0].prompt[:5], 3)], cfg, model_cfg)  # warm-up: compiles the step
            warmup_s = time.perf_counter() - t0
            compiled = counters["unique_graphs"] - graphs
            seconds = float("inf")
            for _ in range(cfg.timed_runs):
                served = fresh(requests)
                with torch._dynamo.config.patch(error_on_recompile=True):
                    t0 = time.perf_counter()
                    stats = serve(engine, served, cfg, model_cfg)
                    seconds = min(seconds, time.perf_counter() - t0)
                if counters["unique_graphs"] != graphs + compiled:
                    raise SystemExit(f"{engine.name}: compiled again after warm-up")
                for r in served:
                    if r.generated != expected[r.rid]:
                        raise SystemExit(f"{engine.name}: request {r.rid} generated {r.generated}, "
                                         f"the plain model {expected[r.rid]}")
            results[engine.name] = dict(seconds=seconds, warmup_s=warmup_s, graphs_compiled=compiled, **stats)
            log(f"{engine.name}: warm-up compiled {compiled} graph(s) in {warmup_s:.1f} s, then {stats['steps']} steps "
                f"with no recompilation ({stats['mixed_kinds']} mixing decode/prefill/chunked-prefill sequences, "
                f"{stats['decode_only']} decode only); {stats['pages_taken']} pages taken from the free list of "
                f"{cfg.total_pages}; {stats['joined_late']} requests joined after others finished; greedy tokens of "
                f"all {len(served)} requests equal the plain model's")
    log(f"\n{'':<38}{'seconds':>9}{'generated tok/s':>17}{'all tok/s':>11}")
    for name, r in results.items():
        r["generated_per_s"] = new_tokens / r["seconds"]
        r["tokens_per_s"] = (prompt_tokens + new_tokens) / r["seconds"]
        log(f"{name:<38}{r['seconds']:>9.2f}{r['generated_per_s']:>17.1f}{r['tokens_per_s']:>11.1f}")
    log(f"(all tok/s: prompt and generated tokens per second; the fastest of {cfg.timed_runs} runs, "
        f"compilation excluded; the whole demo took {time.perf_counter() - start:.0f} s)")
    return results


if __name__ == "__main__":
    run()
