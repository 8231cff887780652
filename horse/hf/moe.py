"""The mixture-of-experts forwards ``horse.hf.apply`` binds (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; Gemma 4's
experts, whose causal LM has no aux loss and keeps ``forwards.causal_lm_forward``).

- The experts (``<Family>Experts``: ``gate_up_proj`` (experts, 2 · inter, hidden), gate rows first, and
  ``down_proj`` (experts, hidden, inter), as transformers packs them): one ``moe_mlp`` call on the module's
  own parameters, read in place (no copy: their gradients land in them). It takes the router's top-k ids
  and weights as the module's own forward does, so the router, its logits (``output_router_logits``) and
  the sparse block around the experts stay transformers' own; so do Qwen2-MoE's shared expert gate (its
  shared expert is a gated MLP, patched as LLaMA's).
- The causal LM: the loss of ``forwards.causal_lm_forward``, plus the load-balancing loss as the model's
  own forward adds it: the modeling module's ``load_balancing_loss_func`` over the router logits, times
  ``router_aux_loss_coef``, when ``output_router_logits`` (the argument, else the config's) is on.
"""

import dataclasses
import functools
import inspect

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.utils import can_return_tuple

from horse.hf import forwards
from horse.hf.attention import check_half_precision
from horse.kernels import moe_mlp
from horse.kernels.moe import ACTIVATIONS


def experts_refusals(name: str, module: nn.Module) -> list[str]:
    """What in an experts module the fused forward cannot run exactly, in words."""
    problems = []
    activation = forwards.activation_of(module.act_fn)
    if activation not in ACTIVATIONS:
        problems.append(f"{name}: activation {type(module.act_fn).__name__}, which moe_mlp lacks")
    for weight in ("gate_up_proj", "down_proj"):
        if type(getattr(module, weight, None)) is not nn.Parameter:
            problems.append(f"{name}.{weight}: not a plain nn.Parameter (quantized or wrapped experts?)")
    return problems


def experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The packed experts' ``Σ_k top_k_weights[t, k] · expert_{top_k_index[t, k]}(hidden_states[t])``, with
    ``expert_e(x) = down_proj[e] (act(gate) ⊙ up)`` and ``gate, up = gate_up_proj[e] x`` split in halves:
    one ``moe_mlp`` call. hidden_states (tokens, hidden); top_k_index, top_k_weights (tokens, top_k)."""
    check_half_precision(hidden_states, type(self).__name__)
    return moe_mlp(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        activation=forwards.activation_of(self.act_fn),
    )


@can_return_tuple
def causal_lm_forward(self, *args, **kwargs):
    """The MoE causal LM's forward: ``forwards.causal_lm_forward``'s loss and logits, with the aux loss and
    its share of the loss as the model's own forward computes them."""
    original = type(self).forward
    arguments = inspect.signature(original).bind(self, *args, **kwargs).arguments
    del arguments["self"]
    extra = arguments.pop("kwargs", {})
    if arguments.get("labels") is not None and self.loss_function is not ForCausalLMLoss:
        return original(self, *args, **kwargs)  # a loss function of the caller's own: the model's forward
    if arguments.get("output_router_logits") is None:
        arguments["output_router_logits"] = self.config.output_router_logits
    outputs = forwards.causal_lm_forward(self, **arguments, **extra, return_dict=True)
    if not arguments["output_router_logits"]:
        return outputs
    load_balancing_loss = inspect.getmodule(type(self)).load_balancing_loss_func
    aux_loss = load_balancing_loss(
        outputs.router_logits, self.num_experts, self.num_experts_per_tok, arguments.get("attention_mask")
    )
    loss = outputs.loss
    if loss is not None:
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    fields = {field.name: getattr(outputs, field.name) for field in dataclasses.fields(outputs)}
    return type(outputs)(**(fields | {"loss": loss, "aux_loss": aux_loss}))


@functools.cache
def causal_lm_forward_for(model_class: type):
    """:func:`causal_lm_forward` showing model_class's own forward's signature (see
    ``forwards.causal_lm_forward_for``)."""

    @functools.wraps(causal_lm_forward)
    def forward(self, *args, **kwargs):
        return causal_lm_forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(model_class.forward)
    return forward
