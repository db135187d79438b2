"""Hugging Face transformers backends running on tokamax ops.

Importing this module (it imports ``transformers``; install with
``pip install tokamax-torch[transformers]``) registers a ``"tokamax"`` backend in

- transformers' ``AttentionInterface``: attention through ``tokamax_torch.dot_product_attention``,
  with the boolean mask of the ``"sdpa"`` backend registered as its mask function in
  ``AttentionMaskInterface``;
- transformers' ``ExpertsInterface``: the MoE experts through ``tokamax_torch.fused_experts``.

Then either ::

    model.set_attn_implementation("tokamax")
    model.set_experts_implementation("tokamax")      # MoE models

or the one-liner ``tokamax_torch.integrations.transformers.apply(model)``, which sets both where
the model has the hook and raises when it has neither. Loading works too:
``from_pretrained(..., attn_implementation="tokamax", experts_implementation="tokamax")``.
"""

from __future__ import annotations

from typing import Optional

import torch
import transformers
from transformers.integrations import moe as _hf_moe
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

import tokamax_torch

#: The name both backends are registered under.
NAME = "tokamax"

__all__ = ["NAME", "apply", "attention_forward", "experts_forward", "register"]


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    softcap: Optional[float] = None,
    position_bias: Optional[torch.Tensor] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface call on ``tokamax_torch.dot_product_attention``.

    ``query[B, N, T, H]``, ``key``/``value[B, K, S, H]`` (transformers' layout, passed to the op
    as transposed views: no copy, no ``repeat_kv``) -> ``(out[B, T, N, H], None)``.
    ``attention_mask`` is what the registered mask function (the ``"sdpa"`` one) built: a bool
    ``[B, 1, T, S]`` mask (True = visible), or None where a plain causal mask is implied (then
    ``is_causal`` runs the kernel's causal path, which skips masked tiles). A float 4-D mask a
    caller prepared itself is added to the logits (the op's ``bias``), as ``eager`` and ``sdpa``
    do. ``softcap`` maps to ``logits_soft_cap``, ``position_bias`` to ``bias``.
    Unsupported, with an error: attention dropout, attention sinks (``s_aux``), and a float mask
    together with ``softcap`` (transformers adds such a mask after capping, the op before).
    """
    if dropout:
        raise NotImplementedError(
            f"tokamax attention: attention dropout is not supported, got dropout={dropout} (the model is in "
            "training mode with config.attention_dropout > 0); set config.attention_dropout = 0.0 or use another "
            "attn_implementation")
    if s_aux is not None:
        raise NotImplementedError("tokamax attention: attention sinks (s_aux) are not supported; use another "
                                  "attn_implementation for this model")
    if kwargs.get("output_attentions", False):
        raise NotImplementedError("tokamax attention: output_attentions=True is not supported (the kernel never "
                                  "forms the attention weights); use attn_implementation='eager' to get them")
    q_length = query.shape[2]
    # As sdpa: a given mask replaces the causal flag, and one query (decode) sees the whole cache.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_length > 1 and attention_mask is None and causal)
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        elif softcap is not None:
            raise NotImplementedError(
                "tokamax attention: a float (additive) attention mask together with softcap is not supported "
                f"(got a {attention_mask.dtype} mask); pass a bool mask (True = visible) instead")
        else:
            bias = attention_mask
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    out = tokamax_torch.dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), bias, mask,
        scale=scaling, is_causal=causal, logits_soft_cap=softcap)
    return out, None


def _activation_name(act_fn) -> Optional[str]:
    """fused_experts' act_fn for a transformers activation module, None when it has none."""
    from transformers import activations

    if isinstance(act_fn, (torch.nn.SiLU, activations.SiLUActivation)):
        return "silu"
    # fused_experts' gelu is the tanh approximation (as jax.nn.gelu's default); the exact-erf
    # "gelu" of transformers is a different function and is not mapped.
    if isinstance(act_fn, (activations.GELUTanh, activations.NewGELUActivation)):
        return "gelu"
    if isinstance(act_fn, torch.nn.GELU) and act_fn.approximate == "tanh":
        return "gelu"
    return None


def _experts_arguments(module: torch.nn.Module) -> dict:
    """fused_experts' weight arguments for a transformers experts module, as views of its
    parameters (no copy); raises for a layout fused_experts cannot run."""
    name = type(module).__name__
    unsupported = []
    if not getattr(module, "has_gate", True):
        unsupported.append("experts without a gate (up_proj only)")
    if not getattr(module, "is_concatenated", True):
        unsupported.append("interleaved gate/up weights (is_concatenated=False)")
    if getattr(module, "has_post_expert_norm", False):
        unsupported.append("a norm after each expert (has_post_expert_norm=True)")
    if getattr(module, "_is_expert_parallel", False):
        unsupported.append("expert parallelism")
    if getattr(type(module), "_apply_gate", _hf_moe._default_apply_gate) is not _hf_moe._default_apply_gate:
        unsupported.append(f"a custom gate ({name}._apply_gate)")
    act = _activation_name(getattr(module, "act_fn", None))
    if act is None:
        unsupported.append(f"the activation {type(getattr(module, 'act_fn', None)).__name__} (fused_experts runs "
                           "silu and tanh-approximated gelu)")
    if unsupported:
        raise NotImplementedError(f"tokamax experts: {name} uses " + ", ".join(unsupported) +
                                  "; use another experts_implementation for this model")
    w1, w2 = module.gate_up_proj, module.down_proj
    if not getattr(module, "is_transposed", False):
        # transformers stores gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I];
        # fused_experts takes [E, H, 2I] and [E, I, H]: transposed views, strides passed through.
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    has_bias = getattr(module, "has_bias", False)
    return dict(w1=w1, w2=w2, act_fn=act, w1_bias=module.gate_up_proj_bias if has_bias else None,
                w2_bias=module.down_proj_bias if has_bias else None)


def experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts-interface call on ``tokamax_torch.fused_experts``.

    ``hidden_states[T, H]``, ``top_k_index[T, k]``, ``top_k_weights[T, k]`` (the routing the
    model's router decided) -> ``[T, H]`` in ``hidden_states``' dtype, with gradients for the
    input, both weights, the biases and the routing weights.
    """
    fused_experts = getattr(tokamax_torch, "fused_experts", None)
    if fused_experts is None:
        raise NotImplementedError("tokamax experts: this tokamax_torch build has no fused_experts op")
    args = _experts_arguments(self)
    w1, w2 = args.pop("w1"), args.pop("w2")
    return fused_experts(hidden_states, w1, w2, top_k_weights, top_k_index, **args)


def register() -> None:
    """Registers the ``"tokamax"`` attention (and its mask function) and experts backends with
    transformers; idempotent, and done when this module is imported."""
    AttentionInterface.register(NAME, attention_forward)
    # The mask the sdpa backend gets is what dot_product_attention takes: bool, True = visible,
    # broadcastable [B, 1, T, S], or None where is_causal alone says it.
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _hf_moe.ExpertsInterface.register(NAME, experts_forward)


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers' ``@use_experts_implementation`` dispatches."""
    return [m for m in model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")]


def apply(model, *, attention: bool = True, experts: bool = True):
    """Runs ``model``'s attention and MoE experts on tokamax ops; returns ``model``.

    The one-liner for ``model.set_attn_implementation("tokamax")`` plus, where the model has MoE
    experts, ``model.set_experts_implementation("tokamax")``. Checks first that every experts
    module has a layout ``fused_experts`` runs, so nothing is switched when one does not.
    Raises ``TypeError`` for an object that is not a transformers model and ``ValueError`` for a
    model whose attention does not go through transformers' attention interface.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"tokamax_torch.integrations.transformers.apply: model must be a transformers "
                        f"PreTrainedModel, got {type(model).__name__}")
    register()
    experts_modules = _experts_modules(model) if experts else []
    for module in experts_modules:
        _experts_arguments(module)
    if attention:
        model.set_attn_implementation(NAME)
        # transformers only logs a warning for a model that cannot switch; make it an error.
        if model.config._attn_implementation != NAME:
            raise ValueError(
                f"tokamax_torch.integrations.transformers.apply: {type(model).__name__} does not route its attention "
                "through transformers' AttentionInterface, so its attention cannot run on tokamax (pass "
                "attention=False to switch only the experts)")
    if experts_modules:
        model.set_experts_implementation(NAME)
        missing = [type(m).__name__ for m in experts_modules if m.config._experts_implementation != NAME]
        if missing:
            raise ValueError(f"tokamax_torch.integrations.transformers.apply: the experts modules "
                             f"{sorted(set(missing))} of {type(model).__name__} did not switch to tokamax")
    return model


register()
