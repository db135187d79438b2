"""examples/serve_demo.py, smaller: a 2-layer model serving 8 requests with continuous batching on
ragged_paged_attention under torch.compile(fullgraph=True, dynamic=True). run() raises SystemExit
when a request's greedy tokens differ from the plain (contiguous cache, SDPA) generation or when a
step compiles again after warm-up; the test also checks the schedule exercised what it claims."""

import importlib.util
import pathlib
import sys

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from contract import copies_in_code

DEMO = pathlib.Path(__file__).resolve().parent.parent / "examples" / "serve_demo.py"


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("serve_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def small_configs(demo):
    model = demo.ModelConfig(vocab=256, dim=128, layers=2, heads=4, kv_heads=2, head_dim=32, hidden=256,
                             max_context=128)
    serve = demo.ServeConfig(requests=8, prompt_lens=(3, 60), new_tokens=(2, 16), max_seqs=4, token_budget=32,
                             page_size=8, total_pages=24, timed_runs=1)
    return model, serve


def test_paged_serving_matches_plain_generation(demo):
    model, serve = small_configs(demo)
    results = demo.run(model, serve, verbose=False)
    for name in ("paged (tokamax)", "gather + SDPA"):
        r = results[name]
        assert r["graphs_compiled"] >= 1  # the warm-up compiled, so the no-recompile check counts something
        assert r["mixed_kinds"] > 0 and r["decode_only"] > 0
        assert r["joined_late"] > 0
        assert r["pages_taken"] > serve.total_pages  # pages went back to the free list and out again
    assert results["plain (one request at a time, SDPA)"]["generated_per_s"] > 0


def test_scheduler_batches_follow_the_op_layout(demo):
    """Decode sequences first, then first prompt chunks, then later chunks; kv_lens include the
    step's tokens; every sequence's pages come from the free list and go back to it."""
    model, serve = small_configs(demo)
    requests = demo.make_requests(serve, model.vocab)
    sched = demo.Scheduler(requests, serve, model)
    pps = model.max_context // serve.page_size
    while not sched.finished():
        b = sched.schedule()
        decode, prefill, total = b.distribution.tolist()
        cu = b.cu_q_lens.tolist()
        assert b.tokens.shape[0] % 8 == 0 and b.tokens.shape[0] >= cu[total]
        assert cu[total] <= serve.token_budget
        for i, r in enumerate(b.requests):
            q = cu[i + 1] - cu[i]
            kv = int(b.kv_lens[i])
            assert q >= 1
            if i < decode:
                assert q == 1 and kv > len(r.prompt)
            elif i < prefill:
                assert kv == q
            else:
                assert kv > q
            pages = b.page_indices[i * pps:(i + 1) * pps].tolist()[:-(-kv // serve.page_size)]
            assert pages == r.pages[:len(pages)]
            assert not set(pages) & set(sched.free_pages)
        sched.update(b, b.tokens[:serve.max_seqs] % model.vocab)
    assert sorted(sched.free_pages) == list(range(serve.total_pages))
    assert all(r.done for r in requests)


def test_the_compiled_step_writes_the_donated_caches_in_place(demo):
    """The step of a whole model (every layer's cache donated to the op) as Inductor compiles it:
    no copy or clone, no buffer of a cache's size; the caches returned are the ones passed."""
    model_cfg, serve = small_configs(demo)
    model = demo.TinyLM(model_cfg).eval()
    engine = demo.PagedEngine(model, serve)
    batch = demo.Scheduler(demo.make_requests(serve, model_cfg.vocab), serve, model_cfg).schedule()
    ptrs = [c.data_ptr() for c in engine.caches]
    with torch.inference_mode():
        (_, caches), codes = run_and_get_code(engine.step, batch.tokens, batch.positions, engine.caches,
                                              batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.distribution)
    assert [c.data_ptr() for c in caches] == ptrs
    assert any(c.abs().sum() > 0 for c in engine.caches)  # the prompt's keys and values were written
    code = "\n".join(codes)
    assert code.count("ragged_paged_attention") >= model_cfg.layers  # the code searched is the step's
    assert not copies_in_code(codes, engine.caches), copies_in_code(codes, engine.caches)
