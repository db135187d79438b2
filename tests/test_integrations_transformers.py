"""The Hugging Face drop-in (tokamax_torch.integrations.transformers) on small random-weight
models built from their configs (no downloads): Mixtral, Qwen3-MoE and a dense Llama.

Each test runs one model with transformers' own eager backends (the loop over experts, the
matmul-softmax attention) and again after ``apply(model)`` on the same weights, and compares."""

import pytest
import torch

import tokamax_torch

transformers = pytest.importorskip("transformers")
from tokamax_torch.integrations import transformers as tt  # noqa: E402

VOCAB = 96


@pytest.fixture(autouse=True)
def op_calls(monkeypatch):
    """Counts the backends' calls of our ops, so a test sees they ran."""
    calls = {"dot_product_attention": 0, "fused_experts": 0}
    for name in calls:
        def counted(*args, _fn=getattr(tokamax_torch, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(tokamax_torch, name, counted)
    return calls


def _config(name: str, dense_routing: bool = False):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=64, attn_implementation="eager",
                  experts_implementation="eager", tie_word_embeddings=False)
    if name == "mixtral":
        experts = 4
        return transformers.MixtralConfig(intermediate_size=48, num_local_experts=experts,
                                          num_experts_per_tok=experts if dense_routing else 2, **common)
    if name == "qwen3_moe":
        experts = 8
        # norm_topk_prob=False: the unrenormalised weights of user-needs §3.2 reach the experts.
        return transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=experts,
                                           num_experts_per_tok=experts if dense_routing else 2,
                                           norm_topk_prob=False, decoder_sparse_step=1, **common)
    if name == "llama":
        return transformers.LlamaConfig(intermediate_size=96, **common)
    raise ValueError(name)


def _model(name: str, dtype=torch.float32, dense_routing: bool = False):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(name, dense_routing)).to(dtype).eval()
    with torch.no_grad():  # a router initialised to zeros would tie every expert
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.normal_(0.0, 0.5)
    return model


def _inputs(batch=2, length=12, pad=3):
    """Token ids and a padding mask, the second row left-padded by `pad` (as generate pads)."""
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask


def _run(model, ids, mask, cotangent, call=None):
    """Logits and every parameter's gradient of sum(logits * cotangent); `call` (default: the
    model) runs the forward."""
    model.zero_grad(set_to_none=True)
    logits = (model if call is None else call)(input_ids=ids, attention_mask=mask).logits
    (logits.float() * cotangent).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_gradients_close(grads, ref_grads, dtype):
    """Every parameter has a gradient in both runs; each matches within the dtype's tolerance,
    the absolute part relative to the tensor's largest gradient."""
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        got = grads[name]
        scale = ref.float().abs().max().item()
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-5 * scale, msg=name)
        else:
            err = (got.float() - ref.float()).abs().max().item()
            assert err <= 5e-2 * scale + 1e-6, f"{name}: max error {err}, largest gradient {scale}"


MODELS = ["mixtral", "qwen3_moe", "llama"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_and_gradients_match_eager(name, dtype, op_calls):
    # bf16 routes every token to every expert: rounding noise could otherwise flip an expert
    # choice between the two runs and the comparison would measure that, not the backends.
    model = _model(name, dtype, dense_routing=dtype == torch.bfloat16)
    ids, mask = _inputs()
    valid = mask.bool()
    # Padded positions are left out: their queries see no key, which each backend answers its
    # own way (eager: a uniform average; tokamax: zeros), and no valid position reads them.
    cotangent = torch.randn(*ids.shape, VOCAB, generator=torch.Generator().manual_seed(2)) * valid[..., None]
    ref_logits, ref_grads = _run(model, ids, mask, cotangent)
    assert op_calls == {"dot_product_attention": 0, "fused_experts": 0}
    tt.apply(model)
    assert model.config._attn_implementation == "tokamax"
    logits, grads = _run(model, ids, mask, cotangent)
    layers = model.config.num_hidden_layers
    assert op_calls["dot_product_attention"] == layers  # one forward call per layer
    assert op_calls["fused_experts"] == (0 if name == "llama" else layers)

    if dtype == torch.float32:
        torch.testing.assert_close(logits[valid], ref_logits[valid], rtol=1e-4, atol=1e-5)
    else:
        scale = ref_logits[valid].float().abs().max()
        assert (logits[valid].float() - ref_logits[valid].float()).abs().max() <= 3e-2 * scale
    assert ref_grads.keys() == {pname for pname, _ in model.named_parameters()}  # every parameter
    _assert_gradients_close(grads, ref_grads, dtype)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", MODELS)
def test_generate_greedy_tokens_match_eager(name, cache, op_calls):
    """A dynamic cache grows with the tokens; a static one is longer than them from the prefill on
    (top-left causal with S > T there, a materialised mask in decode)."""
    model = _model(name)
    ids, mask = _inputs(length=8, pad=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        tt.apply(model)
        got = model.generate(ids, **kwargs)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # prefill plus one decode step per new token but the last, in each layer
    assert op_calls["dot_product_attention"] == model.config.num_hidden_layers * 6


@pytest.mark.parametrize("name, backend", [*((name, "aot_eager") for name in MODELS), ("qwen3_moe", "inductor")])
def test_whole_model_compiles_fullgraph(name, backend):
    """One graph for the whole model, forward and backward, with the tokamax backends (the eager
    experts loop could not: it reads which experts got tokens). aot_eager traces every model
    through the ops' meta kernels and autograd; inductor (slow to compile) runs the MoE model."""
    model = tt.apply(_model(name))
    ids, mask = _inputs()
    valid = mask.bool()
    cotangent = torch.randn(*ids.shape, VOCAB, generator=torch.Generator().manual_seed(2)) * valid[..., None]
    eager_logits, eager_grads = _run(model, ids, mask, cotangent)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    logits, grads = _run(model, ids, mask, cotangent, call=compiled)
    torch.testing.assert_close(logits[valid], eager_logits[valid], rtol=1e-4, atol=1e-5)
    _assert_gradients_close(grads, eager_grads, torch.float32)


def test_compiles_with_dynamic_shapes(monkeypatch):
    """One graph serves several sequence lengths (the ops' meta kernels take symbolic sizes)."""
    from torch._dynamo.utils import counters

    for name in ("dot_product_attention", "fused_experts"):  # the counters would be guarded on
        monkeypatch.setattr(tokamax_torch, name, getattr(tokamax_torch.ops, name).kernel)
    model = tt.apply(_model("qwen3_moe"))
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    counters.clear()
    with torch.no_grad():
        for length in (10, 14):
            ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
            torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits,
                                       rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


def test_models_built_with_the_tokamax_implementations():
    """After the import, "tokamax" is a name transformers accepts when building a model."""
    config = _config("qwen3_moe")
    config._attn_implementation, config._experts_implementation = "tokamax", "tokamax"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.config._attn_implementation == "tokamax"
    assert model.config._experts_implementation == "tokamax"


def test_example_runs(tmp_path):
    """examples/hf_moe.py, shrunk: it exits non-zero when the tokamax losses or tokens differ."""
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).resolve().parent.parent / "examples" / "hf_moe.py"
    out = subprocess.run([sys.executable, str(example), "--steps", "3", "--batch", "2", "--seq", "32",
                          "--new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tokamax losses match eager at every step" in out.stdout
    assert "tokamax tokens == eager tokens" in out.stdout


def test_dense_model_gets_attention_only():
    model = tt.apply(_model("llama"))
    assert model.config._attn_implementation == "tokamax"
    assert model.config._experts_implementation != "tokamax"


def test_apply_errors():
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel"):
        tt.apply(torch.nn.Linear(2, 2))


def test_apply_raises_for_a_model_without_the_attention_hook(monkeypatch):
    model = _model("llama")
    monkeypatch.setattr(type(model), "_can_set_attn_implementation", classmethod(lambda cls: False))
    with pytest.raises(ValueError, match="does not route its attention through"):
        tt.apply(model)


def test_apply_checks_every_experts_module_before_switching():
    model = _model("qwen3_moe")
    model.model.layers[1].mlp.experts.has_post_expert_norm = True
    with pytest.raises(NotImplementedError, match="Qwen3MoeExperts uses a norm after each expert"):
        tt.apply(model)
    assert model.config._attn_implementation == "eager"
    assert model.config._experts_implementation == "eager"


def test_unsupported_features_raise():
    model = _model("llama")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    tt.apply(model).train()
    ids, mask = _inputs()
    with pytest.raises(NotImplementedError, match="attention dropout is not supported"):
        model(input_ids=ids, attention_mask=mask)
    model.eval()
    with pytest.raises(NotImplementedError, match="output_attentions=True is not supported"):
        model(input_ids=ids, attention_mask=mask, output_attentions=True)


def test_float_mask_is_added_to_the_logits():
    """A 4-D float mask a caller prepared is additive, as in eager and sdpa."""
    model = _model("llama")
    ids, _ = _inputs()
    bias = torch.randn(2, 1, 12, 12, generator=torch.Generator().manual_seed(3))
    bias = bias.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=bias).logits
        got = tt.apply(model)(input_ids=ids, attention_mask=bias).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_experts_arguments_are_views_without_copies():
    model = _model("mixtral")
    experts = model.model.layers[0].mlp.experts
    args = tt._experts_arguments(experts)
    assert args["w1"].shape == (4, 64, 96) and args["w2"].shape == (4, 48, 64)
    assert args["w1"].data_ptr() == experts.gate_up_proj.data_ptr()
    assert args["w2"].data_ptr() == experts.down_proj.data_ptr()
    assert args["act_fn"] == "silu"


@pytest.mark.parametrize("layout", ["plain", "biases", "gelu_tanh", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_experts_forward_matches_transformers_batched_mm(layout, dtype):
    """The experts backend alone against transformers' batched_mm backend on one experts module,
    in each layout the backend maps: biases, the tanh gelu, weights stored [E, H, 2I] / [E, I, H]."""
    from transformers.integrations import moe

    config = _config("mixtral")
    if layout == "gelu_tanh":
        config.hidden_act = "gelu_pytorch_tanh"
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config).to(dtype)
    generator = torch.Generator().manual_seed(4)
    E, H, I = experts.num_experts, experts.hidden_dim, experts.intermediate_dim
    with torch.no_grad():
        if layout == "transposed":
            experts.is_transposed = True
            experts.gate_up_proj = torch.nn.Parameter(torch.empty(E, H, 2 * I, dtype=dtype))
            experts.down_proj = torch.nn.Parameter(torch.empty(E, I, H, dtype=dtype))
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=generator) * 0.2)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=generator) * 0.2)
        if layout == "biases":
            experts.has_bias = True
            experts.gate_up_proj_bias = torch.nn.Parameter(torch.randn(E, 2 * I, generator=generator).to(dtype))
            experts.down_proj_bias = torch.nn.Parameter(torch.randn(E, H, generator=generator).to(dtype))
    tokens = 10
    x = torch.randn(tokens, H, generator=generator).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=generator)[:2] for _ in range(tokens)])
    ids[:, 0] = ids[:, 0].clamp(max=E - 2)  # expert E-1 gets few tokens, maybe none
    weights = torch.rand(tokens, 2, generator=generator).requires_grad_()  # fp32, as Mixtral's router gives
    cotangent = torch.randn(tokens, H, generator=generator)

    def run(forward):
        for t in (x, weights, *experts.parameters()):
            t.grad = None
        out = forward(experts, x, ids, weights)
        (out.float() * cotangent).sum().backward()
        return out.detach(), [t.grad.clone() for t in (x, weights, *experts.parameters())]

    out, grads = run(tt.experts_forward)
    # bf16 against transformers in fp32 on the same (bf16-valued) numbers: its bf16 run rounds
    # every intermediate to bf16 and would measure its own error as much as ours.
    experts.float()
    x.data, weights.data = x.data.float(), weights.data.float()
    ref_out, ref_grads = run(moe.batched_mm_experts_forward)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, ref in zip([out, *grads], [ref_out, *ref_grads]):
        err = (got.float() - ref).abs().max().item()
        assert err <= tol * ref.abs().max().item(), (err, ref.abs().max().item())


def test_unsupported_experts_layouts_raise():
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(_config("mixtral"))
    experts.is_concatenated = False
    with pytest.raises(NotImplementedError, match="MixtralExperts uses interleaved gate/up weights"):
        tt._experts_arguments(experts)
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(_config("mixtral"))
    experts.act_fn = torch.nn.GELU()  # exact erf gelu: fused_experts' gelu is the tanh approximation
    with pytest.raises(NotImplementedError, match="the activation GELU"):
        tt._experts_arguments(experts)
